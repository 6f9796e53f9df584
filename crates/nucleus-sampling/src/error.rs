//! Typed errors: per-row errors ([`SampleError`]) and whole-call errors ([`ShapeError`]).

/// A parameter outside its allowed range (spec/sampling.md, "Inputs").
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
#[error("invalid sampling parameter `{field}` = {value}: allowed {allowed}")]
pub struct ParamError {
    /// The field's name, as in [`crate::SamplingParams`].
    pub field: &'static str,
    /// The value that was given, formatted.
    pub value: String,
    /// The allowed range, in words.
    pub allowed: &'static str,
}

impl ParamError {
    pub(crate) fn new(
        field: &'static str,
        value: impl std::fmt::Display,
        allowed: &'static str,
    ) -> Self {
        Self {
            field,
            value: value.to_string(),
            allowed,
        }
    }
}

/// Why one row could not be sampled. The other rows of the batch are unaffected.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
pub enum SampleError {
    /// A NaN or +inf logit at an id below `vocab_size` (spec step 1). `-inf` is legal: it masks.
    #[error("non-finite logit {value:?} at token id {token_id}")]
    NonFiniteLogits {
        /// The lowest id holding a NaN or +inf.
        token_id: u32,
        /// The value found there.
        value: f32,
    },
    /// A probability-input row holds a NaN, infinite or negative value.
    #[error(
        "invalid probability {value:?} at token id {token_id}: probabilities must be finite and >= 0"
    )]
    InvalidProbability {
        /// The lowest offending id.
        token_id: u32,
        /// The value found there.
        value: f32,
    },
    /// No token can be chosen (spec step 12): every logit below `vocab_size` is `-inf` (every
    /// probability 0) after the hard constraints (`allowed_token_ids`, `bad_words`,
    /// `min_tokens`, the token bitmask).
    #[error("no candidate token: every token below vocab_size is removed (logit -inf or probability 0, given so or masked by allowed_token_ids, bad_words, min_tokens or the token bitmask)")]
    NoCandidates,
    /// The request's token bitmask row is shorter than `ceil(vocab_size / 32)` words.
    #[error(transparent)]
    InvalidBitmask(#[from] BitmaskError),
    /// A parameter is out of range.
    #[error(transparent)]
    InvalidParams(#[from] ParamError),
    /// The repetition penalty turned a finite logit into a non-finite value: a penalty so close
    /// to 0, or so large, that `l / r` or `l * r` leaves the f32 range.
    #[error("repetition_penalty {penalty:?} takes the logit {logit:?} of token id {token_id} out of the f32 range")]
    PenaltyOverflow {
        /// The token whose logit overflowed.
        token_id: u32,
        /// Its logit before the penalty.
        logit: f32,
        /// The penalty.
        penalty: f64,
    },
    /// A chain processor turned a finite logit into a non-finite value (e.g. `temperature`'s
    /// `l / T` with `|l| > 3.4e33` and `T = 1e-5`): the result would leave the f32 range.
    #[error("processor `{processor}` takes the logit {logit:?} of token id {token_id} out of the f32 range")]
    ProcessorOverflow {
        /// The processor's name, e.g. `"temperature"`.
        processor: &'static str,
        /// The first token (lowest id) whose logit overflowed.
        token_id: u32,
        /// Its logit before the processor.
        logit: f32,
    },
    /// No seed was given and the operating system's entropy source failed.
    #[error("no seed given and none could be drawn from the OS: {0}")]
    SeedUnavailable(String),
    /// A token id given with the request (context or parameters) is not below `vocab_size`.
    #[error("{field} holds token id {token_id}, not below vocab_size {vocab_size}")]
    TokenIdOutOfRange {
        /// Where the id was: `"prompt_ids"`, `"output_ids"`, `"stop_token_ids"`,
        /// `"logit_bias"`, `"allowed_token_ids"` or `"bad_words"`.
        field: &'static str,
        /// The offending id.
        token_id: u32,
        /// The row's vocabulary size.
        vocab_size: usize,
    },
}

/// A whole call is malformed: the shape of the logits matrix or the number of requests.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ShapeError {
    /// The data slice is shorter than `(batch - 1) * row_stride + row_len`.
    #[error("logits slice has {len} values, but batch {batch} with row_stride {row_stride} and row length {row_len} needs {needed}")]
    DataTooShort {
        /// `data.len()`.
        len: usize,
        /// Rows.
        batch: usize,
        /// Elements between row starts.
        row_stride: usize,
        /// Elements in a row.
        row_len: usize,
        /// The minimum length.
        needed: usize,
    },
    /// `row_len > row_stride`: rows would overlap.
    #[error("row length {row_len} exceeds row_stride {row_stride}")]
    RowLongerThanStride {
        /// Elements in a row.
        row_len: usize,
        /// Elements between row starts.
        row_stride: usize,
    },
    /// `vocab_size` is 0 or larger than the row.
    #[error("vocab_size {vocab_size} must be in 1..={row_len} (the row length)")]
    BadVocabSize {
        /// The given vocabulary size.
        vocab_size: usize,
        /// Elements in a row.
        row_len: usize,
    },
    /// `vocab_size` does not fit the u32 token ids.
    #[error("vocab_size {vocab_size} does not fit in u32 token ids")]
    VocabTooLarge {
        /// The given vocabulary size.
        vocab_size: usize,
    },
    /// The number of requests differs from the number of rows.
    #[error("{requests} requests for {batch} logits rows")]
    RequestCountMismatch {
        /// Requests given.
        requests: usize,
        /// Rows in the logits matrix.
        batch: usize,
    },
}

/// A token bitmask of the wrong shape ([`crate::bitmask`]).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum BitmaskError {
    /// A [`crate::TokenBitmask`]'s words are not `batch * ceil(row_len / 32)`.
    #[error("a token bitmask of {batch} rows of {row_len} ids needs batch * ceil(row_len / 32) words, got {words}")]
    Shape {
        /// Words given.
        words: usize,
        /// Rows.
        batch: usize,
        /// Token ids per row.
        row_len: usize,
    },
    /// One row's mask has fewer than `ceil(row_len / 32)` words.
    #[error("a token bitmask row for {row_len} ids needs at least {needed} u32 words (ceil(row_len / 32)), got {words}")]
    RowTooShort {
        /// Words given.
        words: usize,
        /// Words needed.
        needed: usize,
        /// Token ids in the row.
        row_len: usize,
    },
    /// The logits matrix does not hold the mask's `batch` rows of `row_len` values.
    #[error(
        "logits of {values} values do not match a token bitmask of {batch} rows of {row_len} ids"
    )]
    LogitsShape {
        /// Values in the logits slice.
        values: usize,
        /// The mask's rows.
        batch: usize,
        /// The mask's token ids per row.
        row_len: usize,
    },
}
