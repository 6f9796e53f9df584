//! A chain's configuration as data: [`ProcessorConfig`] and its serde helpers.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use super::*;
use crate::error::ParamError;
use crate::params::LogprobsKind;

/// Why a chain could not be built from a [`ProcessorConfig`] list.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
pub enum ChainError {
    /// The list is empty, or its last entry is not a selection step.
    #[error("a processor chain must end with a selection step (`sample`, `greedy`, `mirostat`, `mirostat_v2` or `adaptive_p`)")]
    NoSelection,
    /// A selection step appears before the last entry.
    #[error("selection step `{name}` at index {index} must be the last entry of the chain")]
    SelectionNotLast {
        /// Its index in the list.
        index: usize,
        /// `"sample"`, `"greedy"`, `"mirostat"`, `"mirostat_v2"` or `"adaptive_p"`.
        name: &'static str,
    },
    /// An entry's parameter is out of range.
    #[error("chain entry {index} (`{name}`): {source}")]
    InvalidParams {
        /// The entry's index in the list.
        index: usize,
        /// The entry's name, e.g. `"temperature"`.
        name: &'static str,
        /// The field, its value and the allowed range.
        source: ParamError,
    },
}

/// One entry of a chain's configuration: a processor with exactly its parameters, or a
/// selection step (STYLE.md point 3: a chain's configuration is data).
///
/// Serialised externally tagged, snake_case, unknown names and fields rejected. In JSON:
///
/// | entry | processor | ranges |
/// |---|---|---|
/// | `{"allowed_token_ids": {"ids": [1, 2]}}` | [`AllowedTokenIds`] | non-empty |
/// | `{"bad_words": {"words": [[1, 2], [3]]}}` | [`BadWords`] | non-empty sequences |
/// | `{"min_tokens": {"min_tokens": 5}}` | [`MinTokens`] | |
/// | `{"logit_bias": {"bias": {"42": -1.5}}}` | [`LogitBias`] (keys: ids as strings) | finite, clamped to ±100 |
/// | `{"repetition_penalty": {"penalty": 1.1}}` | [`RepetitionPenalty`] (optional `prompt_ignore_length`, [`RepetitionPenalty::with_prompt_ignore_length`]) | `> 0` |
/// | `{"frequency_penalty": {"penalty": 0.5}}` | [`FrequencyPresencePenalty::frequency`] | `[-2, 2]` |
/// | `{"presence_penalty": {"penalty": 0.5}}` | [`FrequencyPresencePenalty::presence`] | `[-2, 2]` |
/// | `{"temperature": {"t": 0.8}}` | [`Temperature`] | `>= 1e-5` |
/// | `{"min_p": {"p": 0.05, "min_keep": 1}}` | [`MinP`] (`min_keep` optional, default 1) | `[0, 1]`; `min_keep >= 1` |
/// | `{"top_k": {"k": 50, "min_keep": 1}}` | [`TopK`] (`min_keep` optional, default 1) | `>= -1`; `min_keep >= 1` |
/// | `{"top_p": {"p": 0.9, "min_keep": 1}}` | [`TopP`] (`min_keep` optional, default 1) | `(0, 1]`; `min_keep >= 1` |
/// | `{"sequence_bias": {"sequence_bias": [[[1, 2], -1.5], [[3], 0.5]]}}` | [`SequenceBias`] | non-empty list, non-empty sequences, finite f32 biases |
/// | `{"forced_bos_token": {"bos_token_id": 0}}` | [`ForcedBos`] | |
/// | `{"forced_eos_token": {"max_length": 64, "eos_token_id": [2]}}` | [`ForcedEos`] (`eos_token_id`: an id or a list) | `max_length >= 1`, non-empty ids |
/// | `{"suppress_tokens": {"suppress_tokens": [5, 6]}}` | [`SuppressTokens`] | |
/// | `{"suppress_tokens_at_begin": {"begin_suppress_tokens": [2], "begin_index": 0}}` | [`SuppressTokensAtBegin`] (`begin_index` in generated tokens, default 0) | |
/// | `{"exponential_decay_length_penalty": {"start_index": 10, "decay_factor": 1.05, "eos_token_id": [2]}}` | [`ExponentialDecayLengthPenalty`] (`eos_token_id` optional: the context's stop ids) | finite `decay_factor`, non-empty ids |
/// | `{"encoder_repetition_penalty": {"penalty": 1.2}}` | [`EncoderRepetitionPenalty`] | `> 0` |
/// | `{"inf_nan_remove": {}}` | [`InfNanRemove`] | |
/// | `{"dry": {"multiplier": 0.8, "base": 1.75, "allowed_length": 2, "penalty_last_n": -1, "sequence_breakers": [[13], [25, 7]]}}` | [`Dry`] (all fields optional: multiplier 0 = off, base 1.75, allowed_length 2, penalty_last_n -1 = whole history, no breakers) | multiplier finite `>= 0`, base finite `>= 1`, allowed_length `>= 0`, penalty_last_n `>= -1`, breakers 1 to 21 ids |
/// | `{"no_repeat_ngram": {"ngram_size": 3}}` | [`NoRepeatNGram`] | `> 0` |
/// | `{"encoder_no_repeat_ngram": {"encoder_ngram_size": 3}}` | [`EncoderNoRepeatNGram`] (the prompt's n-grams) | `> 0` |
/// | `{"xtc": {"threshold": 0.1, "probability": 0.5, "min_keep": 1}}` | [`Xtc`] (all optional: 0.1, 0, 1) | threshold `[0, 1]` (above 0.5 off), probability `[0, 1]` (0 off) |
/// | `{"mirostat": {"tau": 5, "eta": 0.1, "m": 100, "seed": 42}}` | [`Selection::Mirostat`] (all optional: 5, 0.1, 100; also `n`, `logprobs`, `logprobs_kind`) | tau, eta finite `>= 0`; m `>= 2` |
/// | `{"mirostat_v2": {"tau": 5, "eta": 0.1, "seed": 42}}` | [`Selection::MirostatV2`] (all optional: 5, 0.1; also `n`, `logprobs`, `logprobs_kind`) | tau, eta finite `>= 0` |
/// | `{"adaptive_p": {"target": 0.5, "decay": 0.9, "seed": 42}}` | [`Selection::AdaptiveP`] (`target` required; decay 0.9; also `n`, `logprobs`, `logprobs_kind`) | target finite `<= 1` (negative off), decay `[0, 0.99]` |
/// | `{"typical": {"p": 0.9, "min_keep": 1}}` | [`Typical`] (`min_keep` optional, default 1) | `(0, 1]`, 1 off; `min_keep >= 1` |
/// | `{"top_n_sigma": {"n": 1.0}}` | [`TopNSigma`] | finite, `<= 0` off |
/// | `{"dynatemp": {"t": 1.0, "range": 0.5, "exponent": 1.0}}` | [`DynamicTemperature`] (`exponent` optional, default 1) | `range` finite (`<= 0`: plain temperature `t >= 1e-5`), else `t >= 0`; `exponent >= 0` |
/// | `{"epsilon": {"epsilon": 0.0003, "min_keep": 1}}` | [`Epsilon`] (`min_keep` optional, default 1) | `(0, 1)`; `min_keep >= 1` |
/// | `{"eta": {"epsilon": 0.0003, "min_keep": 1}}` | [`Eta`] (`min_keep` optional, default 1) | `(0, 1)`; `min_keep >= 1` |
/// | `{"top_h": {"top_h": 0.4}}` | [`TopH`] | `(0, 1]` |
/// | `{"log_softmax": {}}` | [`LogSoftmax`] | |
/// | `{"greedy": {}}` | [`Selection::Greedy`] (optional `n`, `logprobs`, `logprobs_kind`) | |
/// | `{"sample": {"seed": 42, "n": 1, "logprobs": 5, "logprobs_kind": "raw"}}` | [`Selection::Sample`] (all optional) | `n` in `1..=1024` |
///
/// Every f64 field also accepts the strings `"inf"`, `"-inf"` and `"nan"` ([`lenient_f64`]),
/// so that such a value reaches validation and is reported as a [`ParamError`] naming the
/// field. `seed` is a u64, exact above 2^53. `logprobs_kind` is `"processed"` (default) or
/// `"raw"`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", deny_unknown_fields)]
pub enum ProcessorConfig {
    /// [`AllowedTokenIds`].
    AllowedTokenIds {
        /// The allowed ids.
        ids: Vec<u32>,
    },
    /// [`BadWords`].
    BadWords {
        /// The banned sequences.
        words: Vec<Vec<u32>>,
    },
    /// [`MinTokens`].
    MinTokens {
        /// Stop ids are banned until this many tokens were generated.
        min_tokens: usize,
    },
    /// [`LogitBias`].
    LogitBias {
        /// Bias by token id (JSON keys are the ids as strings).
        #[serde(with = "lenient_f64_map")]
        bias: BTreeMap<u32, f64>,
    },
    /// [`RepetitionPenalty`].
    RepetitionPenalty {
        /// `r > 0`.
        #[serde(with = "lenient_f64")]
        penalty: f64,
        /// The first ids of the sequence that do not count (Hugging Face's
        /// `prompt_ignore_length`; default none: every id counts).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        prompt_ignore_length: Option<usize>,
    },
    /// [`FrequencyPresencePenalty::frequency`].
    FrequencyPenalty {
        /// In `[-2, 2]`.
        #[serde(with = "lenient_f64")]
        penalty: f64,
    },
    /// [`FrequencyPresencePenalty::presence`].
    PresencePenalty {
        /// In `[-2, 2]`.
        #[serde(with = "lenient_f64")]
        penalty: f64,
    },
    /// [`Temperature`].
    Temperature {
        /// `T >= 1e-5`.
        #[serde(with = "lenient_f64")]
        t: f64,
    },
    /// [`MinP`].
    MinP {
        /// In `[0, 1]`.
        #[serde(with = "lenient_f64")]
        p: f64,
        /// The best tokens never removed (default 1).
        #[serde(default = "one", skip_serializing_if = "is_one")]
        min_keep: usize,
    },
    /// [`TopK`].
    TopK {
        /// `>= -1`; 0 and -1 are off.
        k: i64,
        /// The best tokens never removed (default 1).
        #[serde(default = "one", skip_serializing_if = "is_one")]
        min_keep: usize,
    },
    /// [`TopP`].
    TopP {
        /// In `(0, 1]`.
        #[serde(with = "lenient_f64")]
        p: f64,
        /// The best tokens never removed (default 1).
        #[serde(default = "one", skip_serializing_if = "is_one")]
        min_keep: usize,
    },
    // [catalogue: constraints and penalties (constraints.rs, penalties.rs)]
    /// [`SequenceBias`].
    SequenceBias {
        /// `[[token ids, bias], ...]`, Hugging Face's list form.
        #[serde(with = "crate::chain::penalties::sequence_bias_serde")]
        sequence_bias: Vec<(Vec<u32>, f64)>,
    },
    /// [`ForcedBos`].
    ForcedBosToken {
        /// The token forced as the first generated one.
        bos_token_id: u32,
    },
    /// [`ForcedEos`].
    ForcedEosToken {
        /// The whole sequence's maximum length, prompt included, `>= 1`.
        max_length: usize,
        /// The EOS id(s): an id or a non-empty list.
        #[serde(deserialize_with = "crate::chain::constraints::token_ids::one_or_many")]
        eos_token_id: Vec<u32>,
    },
    /// [`SuppressTokens`].
    SuppressTokens {
        /// The ids banned at every step.
        suppress_tokens: Vec<u32>,
    },
    /// [`SuppressTokensAtBegin`].
    SuppressTokensAtBegin {
        /// The ids banned at the step `begin_index`.
        begin_suppress_tokens: Vec<u32>,
        /// Generated tokens before that step (default 0: the first generated token).
        #[serde(default, skip_serializing_if = "is_zero")]
        begin_index: usize,
    },
    /// [`ExponentialDecayLengthPenalty`].
    ExponentialDecayLengthPenalty {
        /// Generated tokens after which the penalty starts.
        start_index: usize,
        /// A finite factor.
        #[serde(with = "lenient_f64")]
        decay_factor: f64,
        /// The EOS id(s): an id or a non-empty list (default: the context's stop ids).
        #[serde(
            default,
            deserialize_with = "crate::chain::constraints::token_ids::optional",
            skip_serializing_if = "Option::is_none"
        )]
        eos_token_id: Option<Vec<u32>>,
    },
    /// [`EncoderRepetitionPenalty`].
    EncoderRepetitionPenalty {
        /// `p > 0`.
        #[serde(with = "lenient_f64")]
        penalty: f64,
    },
    /// [`InfNanRemove`].
    InfNanRemove {},
    //
    // [catalogue: temperature and entropy, filters (temperature.rs, filters.rs)]
    /// [`Typical`].
    Typical {
        /// In `(0, 1]`; 1 is off.
        #[serde(with = "lenient_f64")]
        p: f64,
        /// Tokens never removed (default 1).
        #[serde(default = "one", skip_serializing_if = "is_one")]
        min_keep: usize,
    },
    /// [`TopNSigma`].
    TopNSigma {
        /// Finite; `<= 0` is off.
        #[serde(with = "lenient_f64")]
        n: f64,
    },
    /// [`DynamicTemperature`].
    Dynatemp {
        /// The centre temperature.
        #[serde(with = "lenient_f64")]
        t: f64,
        /// The half-width of the range; `<= 0` is the plain temperature `t`.
        #[serde(with = "lenient_f64")]
        range: f64,
        /// The exponent of the entropy mapping (default 1).
        #[serde(
            default = "one_f64",
            with = "lenient_f64",
            skip_serializing_if = "is_one_f64"
        )]
        exponent: f64,
    },
    /// [`Epsilon`].
    Epsilon {
        /// In `(0, 1)`.
        #[serde(with = "lenient_f64")]
        epsilon: f64,
        /// The best tokens never removed (default 1).
        #[serde(default = "one", skip_serializing_if = "is_one")]
        min_keep: usize,
    },
    /// [`Eta`] (Hugging Face's `EtaLogitsWarper` argument name, `epsilon`).
    Eta {
        /// In `(0, 1)`.
        #[serde(with = "lenient_f64")]
        epsilon: f64,
        /// The best tokens never removed (default 1).
        #[serde(default = "one", skip_serializing_if = "is_one")]
        min_keep: usize,
    },
    /// [`TopH`].
    TopH {
        /// In `(0, 1]`.
        #[serde(with = "lenient_f64")]
        top_h: f64,
    },
    /// [`LogSoftmax`] (Hugging Face's `LogitNormalization`).
    LogSoftmax {},
    //
    // [catalogue: repetition avoidance (repetition.rs)]
    //
    /// [`Dry`]. Every field is optional (llama.cpp's defaults).
    Dry {
        /// Penalty scale, finite `>= 0`; 0 (the default) is off.
        #[serde(default, with = "lenient_f64")]
        multiplier: f64,
        /// Growth per repeated token beyond `allowed_length`, finite `>= 1` (default 1.75).
        #[serde(default = "super::repetition::dry_default_base", with = "lenient_f64")]
        base: f64,
        /// Repeats up to this length are free (default 2).
        #[serde(default = "super::repetition::dry_default_allowed_length")]
        allowed_length: i64,
        /// How many of the last tokens are searched: -1 (default) the whole history, 0 off.
        #[serde(default = "super::repetition::dry_default_penalty_last_n")]
        penalty_last_n: i64,
        /// Breakers as token-id sequences `[head, tail...]`. Absent: none here (the string
        /// defaults need a tokenizer; a front end that has one resolves
        /// [`DRY_DEFAULT_SEQUENCE_BREAKERS`] with [`resolve_sequence_breakers`] and fills this
        /// in); `[]`: none.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        sequence_breakers: Option<Vec<Vec<u32>>>,
    },
    /// [`NoRepeatNGram`].
    #[serde(rename = "no_repeat_ngram")]
    NoRepeatNGram {
        /// `> 0`.
        ngram_size: i64,
    },
    /// [`EncoderNoRepeatNGram`].
    #[serde(rename = "encoder_no_repeat_ngram")]
    EncoderNoRepeatNGram {
        /// `> 0`.
        encoder_ngram_size: i64,
    },
    // [catalogue: stochastic (stochastic.rs)]
    //
    /// [`Xtc`].
    Xtc {
        /// The probability a token must reach to be excluded (default 0.1).
        #[serde(
            default = "super::stochastic::defaults::xtc_threshold",
            with = "lenient_f64"
        )]
        threshold: f64,
        /// The chance per row that XTC applies (default 0: off).
        #[serde(default, with = "lenient_f64")]
        probability: f64,
        /// The fewest candidates XTC leaves (default 1).
        #[serde(default = "super::stochastic::defaults::min_keep")]
        min_keep: usize,
    },
    /// [`Selection::Mirostat`].
    Mirostat {
        /// Target surprise in bits (default 5).
        #[serde(
            default = "super::stochastic::defaults::mirostat_tau",
            with = "lenient_f64"
        )]
        tau: f64,
        /// Learning rate (default 0.1).
        #[serde(
            default = "super::stochastic::defaults::mirostat_eta",
            with = "lenient_f64"
        )]
        eta: f64,
        /// Tokens in the estimate (default 100).
        #[serde(default = "super::stochastic::defaults::mirostat_m")]
        m: usize,
        /// The stream's seed (default: drawn from the OS on every call).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        seed: Option<u64>,
        /// Samples per row (default 1).
        #[serde(default = "one", skip_serializing_if = "is_one")]
        n: usize,
        /// Top log-probabilities to report (default none).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        logprobs: Option<usize>,
        /// `"processed"` (default) or `"raw"`.
        #[serde(
            default,
            with = "logprobs_kind_serde",
            skip_serializing_if = "is_processed"
        )]
        logprobs_kind: LogprobsKind,
    },
    /// [`Selection::MirostatV2`].
    MirostatV2 {
        /// Target surprise in bits (default 5).
        #[serde(
            default = "super::stochastic::defaults::mirostat_tau",
            with = "lenient_f64"
        )]
        tau: f64,
        /// Learning rate (default 0.1).
        #[serde(
            default = "super::stochastic::defaults::mirostat_eta",
            with = "lenient_f64"
        )]
        eta: f64,
        /// The stream's seed (default: drawn from the OS on every call).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        seed: Option<u64>,
        /// Samples per row (default 1).
        #[serde(default = "one", skip_serializing_if = "is_one")]
        n: usize,
        /// Top log-probabilities to report (default none).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        logprobs: Option<usize>,
        /// `"processed"` (default) or `"raw"`.
        #[serde(
            default,
            with = "logprobs_kind_serde",
            skip_serializing_if = "is_processed"
        )]
        logprobs_kind: LogprobsKind,
    },
    /// [`Selection::AdaptiveP`].
    AdaptiveP {
        /// Target probability (required; negative disables the transform).
        #[serde(with = "lenient_f64")]
        target: f64,
        /// Moving-average decay (default 0.9).
        #[serde(
            default = "super::stochastic::defaults::adaptive_decay",
            with = "lenient_f64"
        )]
        decay: f64,
        /// The stream's seed (default: drawn from the OS on every call).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        seed: Option<u64>,
        /// Samples per row (default 1).
        #[serde(default = "one", skip_serializing_if = "is_one")]
        n: usize,
        /// Top log-probabilities to report (default none).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        logprobs: Option<usize>,
        /// `"processed"` (default) or `"raw"`.
        #[serde(
            default,
            with = "logprobs_kind_serde",
            skip_serializing_if = "is_processed"
        )]
        logprobs_kind: LogprobsKind,
    },
    /// [`Selection::Greedy`].
    Greedy {
        /// Copies of the token (default 1).
        #[serde(default = "one", skip_serializing_if = "is_one")]
        n: usize,
        /// Top log-probabilities to report (default none).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        logprobs: Option<usize>,
        /// `"processed"` (default) or `"raw"`.
        #[serde(
            default,
            with = "logprobs_kind_serde",
            skip_serializing_if = "is_processed"
        )]
        logprobs_kind: LogprobsKind,
    },
    /// [`Selection::Sample`].
    Sample {
        /// The stream's seed (default: drawn from the OS on every call).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        seed: Option<u64>,
        /// Samples per row (default 1).
        #[serde(default = "one", skip_serializing_if = "is_one")]
        n: usize,
        /// Top log-probabilities to report (default none).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        logprobs: Option<usize>,
        /// `"processed"` (default) or `"raw"`.
        #[serde(
            default,
            with = "logprobs_kind_serde",
            skip_serializing_if = "is_processed"
        )]
        logprobs_kind: LogprobsKind,
    },
}

fn one() -> usize {
    1
}

fn is_one(n: &usize) -> bool {
    *n == 1
}

fn is_zero(n: &usize) -> bool {
    *n == 0
}

fn one_f64() -> f64 {
    1.0
}

fn is_one_f64(x: &f64) -> bool {
    *x == 1.0
}

fn is_processed(kind: &LogprobsKind) -> bool {
    *kind == LogprobsKind::Processed
}

impl ProcessorConfig {
    /// The entry's name, as in JSON (`"top_k"`, `"sample"`, ...).
    pub fn name(&self) -> &'static str {
        match self {
            ProcessorConfig::AllowedTokenIds { .. } => "allowed_token_ids",
            ProcessorConfig::BadWords { .. } => "bad_words",
            ProcessorConfig::MinTokens { .. } => "min_tokens",
            ProcessorConfig::LogitBias { .. } => "logit_bias",
            ProcessorConfig::RepetitionPenalty { .. } => "repetition_penalty",
            ProcessorConfig::FrequencyPenalty { .. } => "frequency_penalty",
            ProcessorConfig::PresencePenalty { .. } => "presence_penalty",
            ProcessorConfig::Temperature { .. } => "temperature",
            ProcessorConfig::MinP { .. } => "min_p",
            ProcessorConfig::TopK { .. } => "top_k",
            ProcessorConfig::TopP { .. } => "top_p",
            // [catalogue: constraints and penalties (constraints.rs, penalties.rs)]
            ProcessorConfig::SequenceBias { .. } => "sequence_bias",
            ProcessorConfig::ForcedBosToken { .. } => "forced_bos_token",
            ProcessorConfig::ForcedEosToken { .. } => "forced_eos_token",
            ProcessorConfig::SuppressTokens { .. } => "suppress_tokens",
            ProcessorConfig::SuppressTokensAtBegin { .. } => "suppress_tokens_at_begin",
            ProcessorConfig::ExponentialDecayLengthPenalty { .. } => {
                "exponential_decay_length_penalty"
            }
            ProcessorConfig::EncoderRepetitionPenalty { .. } => "encoder_repetition_penalty",
            ProcessorConfig::InfNanRemove {} => "inf_nan_remove",
            //
            // [catalogue: temperature and entropy, filters (temperature.rs, filters.rs)]
            ProcessorConfig::Typical { .. } => "typical",
            ProcessorConfig::TopNSigma { .. } => "top_n_sigma",
            ProcessorConfig::Dynatemp { .. } => "dynatemp",
            ProcessorConfig::Epsilon { .. } => "epsilon",
            ProcessorConfig::Eta { .. } => "eta",
            ProcessorConfig::TopH { .. } => "top_h",
            ProcessorConfig::LogSoftmax {} => "log_softmax",
            //
            // [catalogue: repetition avoidance (repetition.rs)]
            //
            ProcessorConfig::Dry { .. } => "dry",
            ProcessorConfig::NoRepeatNGram { .. } => "no_repeat_ngram",
            ProcessorConfig::EncoderNoRepeatNGram { .. } => "encoder_no_repeat_ngram",
            // [catalogue: stochastic (stochastic.rs)]
            //
            ProcessorConfig::Xtc { .. } => "xtc",
            ProcessorConfig::Mirostat { .. } => "mirostat",
            ProcessorConfig::MirostatV2 { .. } => "mirostat_v2",
            ProcessorConfig::AdaptiveP { .. } => "adaptive_p",
            ProcessorConfig::Greedy { .. } => "greedy",
            ProcessorConfig::Sample { .. } => "sample",
        }
    }

    /// Whether this is a selection step (`sample`, `greedy`, `mirostat`, `mirostat_v2`,
    /// `adaptive_p`).
    pub fn is_selection(&self) -> bool {
        matches!(
            self,
            ProcessorConfig::Greedy { .. }
                | ProcessorConfig::Sample { .. }
                | ProcessorConfig::Mirostat { .. }
                | ProcessorConfig::MirostatV2 { .. }
                | ProcessorConfig::AdaptiveP { .. }
        )
    }

    /// The selection step, for the selection entries (not validated; see
    /// [`Selection::validate`]).
    pub fn to_selection(&self) -> Option<Selection> {
        match *self {
            ProcessorConfig::Greedy {
                n,
                logprobs,
                logprobs_kind,
            } => Some(Selection::Greedy {
                n,
                logprobs,
                logprobs_kind,
            }),
            ProcessorConfig::Sample {
                seed,
                n,
                logprobs,
                logprobs_kind,
            } => Some(Selection::Sample {
                seed,
                n,
                logprobs,
                logprobs_kind,
            }),
            ProcessorConfig::Mirostat {
                tau,
                eta,
                m,
                seed,
                n,
                logprobs,
                logprobs_kind,
            } => Some(Selection::Mirostat {
                tau,
                eta,
                m,
                seed,
                n,
                logprobs,
                logprobs_kind,
            }),
            ProcessorConfig::MirostatV2 {
                tau,
                eta,
                seed,
                n,
                logprobs,
                logprobs_kind,
            } => Some(Selection::MirostatV2 {
                tau,
                eta,
                seed,
                n,
                logprobs,
                logprobs_kind,
            }),
            ProcessorConfig::AdaptiveP {
                target,
                decay,
                seed,
                n,
                logprobs,
                logprobs_kind,
            } => Some(Selection::AdaptiveP {
                target,
                decay,
                seed,
                n,
                logprobs,
                logprobs_kind,
            }),
            _ => None,
        }
    }

    /// The processor, validated; `None` for a selection step.
    ///
    /// # Errors
    /// The processor's [`ParamError`] (see each processor's `new`).
    pub fn to_processor(&self) -> Result<Option<Box<dyn LogitsProcessor>>, ParamError> {
        let p: Box<dyn LogitsProcessor> = match self {
            ProcessorConfig::AllowedTokenIds { ids } => {
                Box::new(AllowedTokenIds::new(ids.clone())?)
            }
            ProcessorConfig::BadWords { words } => Box::new(BadWords::new(words.clone())?),
            ProcessorConfig::MinTokens { min_tokens } => Box::new(MinTokens::new(*min_tokens)),
            ProcessorConfig::LogitBias { bias } => Box::new(LogitBias::new(bias.clone())?),
            ProcessorConfig::RepetitionPenalty {
                penalty,
                prompt_ignore_length,
            } => {
                let p = RepetitionPenalty::new(*penalty)?;
                Box::new(match *prompt_ignore_length {
                    Some(n) => p.with_prompt_ignore_length(n),
                    None => p,
                })
            }
            ProcessorConfig::FrequencyPenalty { penalty } => {
                Box::new(FrequencyPresencePenalty::frequency(*penalty)?)
            }
            ProcessorConfig::PresencePenalty { penalty } => {
                Box::new(FrequencyPresencePenalty::presence(*penalty)?)
            }
            ProcessorConfig::Temperature { t } => Box::new(Temperature::new(*t)?),
            ProcessorConfig::MinP { p, min_keep } => {
                Box::new(MinP::new(*p)?.with_min_keep(*min_keep)?)
            }
            ProcessorConfig::TopK { k, min_keep } => {
                Box::new(TopK::new(*k)?.with_min_keep(*min_keep)?)
            }
            ProcessorConfig::TopP { p, min_keep } => {
                Box::new(TopP::new(*p)?.with_min_keep(*min_keep)?)
            }
            // [catalogue: constraints and penalties (constraints.rs, penalties.rs)]
            ProcessorConfig::SequenceBias { sequence_bias } => {
                Box::new(SequenceBias::new(sequence_bias.clone())?)
            }
            ProcessorConfig::ForcedBosToken { bos_token_id } => {
                Box::new(ForcedBos::new(*bos_token_id))
            }
            ProcessorConfig::ForcedEosToken {
                max_length,
                eos_token_id,
            } => Box::new(ForcedEos::new(*max_length, eos_token_id.clone())?),
            ProcessorConfig::SuppressTokens { suppress_tokens } => {
                Box::new(SuppressTokens::new(suppress_tokens.clone()))
            }
            ProcessorConfig::SuppressTokensAtBegin {
                begin_suppress_tokens,
                begin_index,
            } => Box::new(SuppressTokensAtBegin::new(
                begin_suppress_tokens.clone(),
                *begin_index,
            )),
            ProcessorConfig::ExponentialDecayLengthPenalty {
                start_index,
                decay_factor,
                eos_token_id,
            } => Box::new(ExponentialDecayLengthPenalty::new(
                *start_index,
                *decay_factor,
                eos_token_id.clone(),
            )?),
            ProcessorConfig::EncoderRepetitionPenalty { penalty } => {
                Box::new(EncoderRepetitionPenalty::new(*penalty)?)
            }
            ProcessorConfig::InfNanRemove {} => Box::new(InfNanRemove::new()),
            //
            // [catalogue: temperature and entropy, filters (temperature.rs, filters.rs)]
            ProcessorConfig::Typical { p, min_keep } => {
                Box::new(Typical::new(*p)?.with_min_keep(*min_keep)?)
            }
            ProcessorConfig::TopNSigma { n } => Box::new(TopNSigma::new(*n)?),
            ProcessorConfig::Dynatemp { t, range, exponent } => {
                Box::new(DynamicTemperature::new(*t, *range, *exponent)?)
            }
            ProcessorConfig::Epsilon { epsilon, min_keep } => {
                Box::new(Epsilon::new(*epsilon)?.with_min_keep(*min_keep)?)
            }
            ProcessorConfig::Eta { epsilon, min_keep } => {
                Box::new(Eta::new(*epsilon)?.with_min_keep(*min_keep)?)
            }
            ProcessorConfig::TopH { top_h } => Box::new(TopH::new(*top_h)?),
            ProcessorConfig::LogSoftmax {} => Box::new(LogSoftmax::new()),
            //
            // [catalogue: repetition avoidance (repetition.rs)]
            //
            ProcessorConfig::Dry {
                multiplier,
                base,
                allowed_length,
                penalty_last_n,
                sequence_breakers,
            } => Box::new(Dry::new(
                *multiplier,
                *base,
                *allowed_length,
                *penalty_last_n,
                sequence_breakers.clone().unwrap_or_default(),
            )?),
            ProcessorConfig::NoRepeatNGram { ngram_size } => {
                Box::new(NoRepeatNGram::new(*ngram_size)?)
            }
            ProcessorConfig::EncoderNoRepeatNGram { encoder_ngram_size } => {
                Box::new(EncoderNoRepeatNGram::new(*encoder_ngram_size)?)
            }
            // [catalogue: stochastic (stochastic.rs)]
            //
            ProcessorConfig::Xtc {
                threshold,
                probability,
                min_keep,
            } => Box::new(Xtc::new(*threshold, *probability, *min_keep)?),
            ProcessorConfig::Mirostat { .. }
            | ProcessorConfig::MirostatV2 { .. }
            | ProcessorConfig::AdaptiveP { .. } => return Ok(None),
            ProcessorConfig::Greedy { .. } | ProcessorConfig::Sample { .. } => return Ok(None),
        };
        Ok(Some(p))
    }
}

/// Serde helpers for an f64 that may also be written as the strings `"inf"` (or `"+inf"`,
/// `"infinity"`), `"-inf"` (`"-infinity"`) or `"nan"`, case-insensitive: JSON has no
/// non-finite numbers, and a configuration should reach validation with such a value (a
/// [`ParamError`] naming the field) instead of failing to parse. Finite values serialise as
/// numbers, non-finite ones as those strings.
///
/// Use with `#[serde(with = "nucleus_sampling::chain::lenient_f64")]`, or
/// `deserialize_with = "nucleus_sampling::chain::lenient_f64::deserialize"`.
pub mod lenient_f64 {
    use serde::de::{self, Visitor};
    use serde::{Deserializer, Serializer};
    use std::fmt;

    /// Writes a finite value as a number, a non-finite one as `"inf"`, `"-inf"` or `"nan"`.
    ///
    /// # Errors
    /// The serializer's.
    pub fn serialize<S: Serializer>(value: &f64, serializer: S) -> Result<S::Ok, S::Error> {
        if value.is_finite() {
            serializer.serialize_f64(*value)
        } else if value.is_nan() {
            serializer.serialize_str("nan")
        } else if *value > 0.0 {
            serializer.serialize_str("inf")
        } else {
            serializer.serialize_str("-inf")
        }
    }

    /// Reads a number (integer or float) or one of the strings above.
    ///
    /// # Errors
    /// Any other string or type (a serde error).
    pub fn deserialize<'de, D: Deserializer<'de>>(deserializer: D) -> Result<f64, D::Error> {
        deserializer.deserialize_any(LenientVisitor)
    }

    struct LenientVisitor;

    impl Visitor<'_> for LenientVisitor {
        type Value = f64;
        fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            f.write_str("a number, or one of the strings \"inf\", \"-inf\", \"nan\"")
        }
        fn visit_f64<E: de::Error>(self, v: f64) -> Result<f64, E> {
            Ok(v)
        }
        fn visit_i64<E: de::Error>(self, v: i64) -> Result<f64, E> {
            Ok(v as f64)
        }
        fn visit_u64<E: de::Error>(self, v: u64) -> Result<f64, E> {
            Ok(v as f64)
        }
        fn visit_str<E: de::Error>(self, v: &str) -> Result<f64, E> {
            match v.trim().to_ascii_lowercase().as_str() {
                "inf" | "+inf" | "infinity" | "+infinity" => Ok(f64::INFINITY),
                "-inf" | "-infinity" => Ok(f64::NEG_INFINITY),
                "nan" | "+nan" | "-nan" => Ok(f64::NAN),
                _ => Err(E::invalid_value(de::Unexpected::Str(v), &self)),
            }
        }
    }
}

/// An f64 that (de)serialises through [`lenient_f64`]: for containers such as
/// `Option<LenientF64>` or maps.
#[derive(Clone, Copy, Debug, PartialEq, PartialOrd, Default)]
pub struct LenientF64(pub f64);

impl Serialize for LenientF64 {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        lenient_f64::serialize(&self.0, serializer)
    }
}

impl<'de> Deserialize<'de> for LenientF64 {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        lenient_f64::deserialize(deserializer).map(LenientF64)
    }
}

/// [`lenient_f64`] for the values of a `BTreeMap<u32, f64>` (the `logit_bias` map; JSON keys
/// are the ids as strings). Use with `#[serde(with = "nucleus_sampling::chain::lenient_f64_map")]`.
pub mod lenient_f64_map {
    use super::LenientF64;
    use serde::{Deserializer, Serialize, Serializer};
    use std::collections::BTreeMap;

    /// Writes the map with [`super::lenient_f64`] values.
    ///
    /// # Errors
    /// The serializer's.
    pub fn serialize<S: Serializer>(
        map: &BTreeMap<u32, f64>,
        serializer: S,
    ) -> Result<S::Ok, S::Error> {
        let wrapped: BTreeMap<u32, LenientF64> =
            map.iter().map(|(&k, &v)| (k, LenientF64(v))).collect();
        wrapped.serialize(serializer)
    }

    /// Reads the map with [`super::lenient_f64`] values.
    ///
    /// # Errors
    /// A key that is not a u32, a token id given twice (never silently one of them), or a
    /// value [`super::lenient_f64::deserialize`] rejects.
    pub fn deserialize<'de, D: Deserializer<'de>>(
        deserializer: D,
    ) -> Result<BTreeMap<u32, f64>, D::Error> {
        struct Visitor;
        impl<'de> serde::de::Visitor<'de> for Visitor {
            type Value = BTreeMap<u32, f64>;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("an object of token id -> bias")
            }
            fn visit_map<A: serde::de::MapAccess<'de>>(
                self,
                mut access: A,
            ) -> Result<Self::Value, A::Error> {
                let mut map = BTreeMap::new();
                while let Some((id, bias)) = access.next_entry::<u32, LenientF64>()? {
                    if map.insert(id, bias.0).is_some() {
                        return Err(serde::de::Error::custom(format!(
                            "token id {id} appears more than once"
                        )));
                    }
                }
                Ok(map)
            }
        }
        deserializer.deserialize_map(Visitor)
    }
}

/// [`LogprobsKind`] as `"processed"` / `"raw"`.
mod logprobs_kind_serde {
    use crate::params::LogprobsKind;
    use serde::de::{self, Deserialize, Deserializer};
    use serde::Serializer;

    pub fn serialize<S: Serializer>(kind: &LogprobsKind, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(kind.as_str())
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<LogprobsKind, D::Error> {
        let s = std::borrow::Cow::<'de, str>::deserialize(d)?;
        match &*s {
            "processed" => Ok(LogprobsKind::Processed),
            "raw" => Ok(LogprobsKind::Raw),
            other => Err(de::Error::unknown_variant(other, &["processed", "raw"])),
        }
    }
}
