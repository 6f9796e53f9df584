//! Per-request sampling parameters and their validation (spec/sampling.md, "Inputs").

use std::collections::BTreeMap;

use crate::error::ParamError;

/// The bound of `logit_bias` values: larger magnitudes are clamped to it (OpenAI, vLLM).
pub const LOGIT_BIAS_LIMIT: f64 = 100.0;

/// Temperatures below this are greedy (spec/sampling.md step 6).
pub const GREEDY_TEMPERATURE: f64 = 1e-5;

/// The parameters of one request, named as in vLLM and the OpenAI API.
///
/// Every field has an "off" value, and [`SamplingParams::default`] turns everything off at
/// temperature 1 (plain sampling from the softmax of the logits). Build one with struct update
/// syntax and check it with [`SamplingParams::validate`]:
///
/// ```
/// use nucleus_sampling::SamplingParams;
/// let params = SamplingParams { temperature: 0.8, top_k: 50, top_p: 0.9, seed: Some(42), ..Default::default() };
/// params.validate().unwrap();
/// ```
///
/// The order in which the parameters act is fixed (spec/sampling.md, "Order of operations"):
/// hard constraints (`allowed_token_ids`, `bad_words`, `min_tokens`), `logit_bias`,
/// repetition penalty, frequency and presence penalties, temperature (or greedy), `min_p`,
/// `top_k`, `top_p`, then selection.
#[derive(Clone, Debug, PartialEq)]
pub struct SamplingParams {
    /// Softmax temperature, `>= 0`. Below [`GREEDY_TEMPERATURE`] (1e-5, so 0 included) the
    /// token is chosen greedily: the argmax, ties to the lowest id. Default 1.
    pub temperature: f64,
    /// Keep exactly the `top_k` largest logits, ties broken toward the lower token id.
    /// `0`, `-1` (vLLM's legacy spelling) and any value `>= vocab_size` are off; other negative
    /// values are an error. Default 0 (off).
    pub top_k: i64,
    /// Keep the smallest set of tokens, in probability order (ties toward the lower id), whose
    /// renormalised mass is `>= top_p`. Range `(0, 1]`; 1 is off. Default 1.
    pub top_p: f64,
    /// Repetition penalty over the distinct ids of prompt + generated tokens:
    /// `l > 0 ? l / r : l * r` (CTRL, Keskar et al. 2019; Hugging Face's
    /// `RepetitionPenaltyLogitsProcessor`). Range `> 0` (finite); 1 is off. Default 1.
    pub repetition_penalty: f64,
    /// Keep tokens whose probability is `>= min_p * p_max` (ties with the threshold kept),
    /// after temperature (Nguyen et al. 2024, "Min P sampling"; vLLM, llama.cpp). Range
    /// `[0, 1]`; 0 is off. Default 0.
    pub min_p: f64,
    /// Subtracted once from the logit of every token that occurs in the generated ids
    /// (OpenAI's definition; prompt ids do not count). Range `[-2, 2]`; 0 is off. Default 0.
    pub presence_penalty: f64,
    /// Subtracted from the logit of every token once per occurrence in the generated ids
    /// (OpenAI's definition). Range `[-2, 2]`; 0 is off. Default 0.
    pub frequency_penalty: f64,
    /// Additive biases by token id, applied after the hard constraints. Each value must be
    /// finite and is clamped to `[-100, 100]` (OpenAI, vLLM). Ids must be below `vocab_size`.
    /// Default empty.
    pub logit_bias: BTreeMap<u32, f64>,
    /// When set, only these ids may be chosen (every other logit becomes -inf). Must not be
    /// empty; ids must be below `vocab_size`. Default `None` (all ids allowed).
    pub allowed_token_ids: Option<Vec<u32>>,
    /// Banned token sequences (vLLM's `bad_words` as token ids): the last token of a sequence is
    /// banned when the generated ids end with the rest of it; a one-token sequence is always
    /// banned. Sequences must not be empty; ids must be below `vocab_size`. Default empty.
    pub bad_words: Vec<Vec<u32>>,
    /// EOS and stop ids ([`crate::SampleRequest::stop_token_ids`]) are banned until this many
    /// tokens have been generated. Default 0.
    pub min_tokens: usize,
    /// The seed of this request's Philox4x32-10 stream. `None`: drawn from the OS for this call
    /// and reported back in [`crate::SampleOutput::seed`]; an engine draws it once per request.
    pub seed: Option<u64>,
    /// Number of samples drawn from the one processed distribution of a row, with sample
    /// indices `sample_index .. sample_index + n` (spec/sampling.md, "Random streams"). The
    /// first is [`crate::SampleOutput::token`], the others
    /// [`crate::SampleOutput::extra_samples`]. Range `1..=`[`MAX_N`]. Default 1.
    pub n: usize,
    /// Log-probabilities to report: `None` reports none; `Some(0)` the chosen tokens' only;
    /// `Some(k)` also the `k` most likely tokens (ties toward the lower id), of the kind
    /// [`Self::logprobs_kind`] (OpenAI's `top_logprobs`, vLLM's `logprobs`). At most
    /// `vocab_size`. Default `None`.
    pub logprobs: Option<usize>,
    /// Which distribution [`Self::logprobs`] reports: the raw logits' log-softmax (spec step 2)
    /// or the processed distribution that selection draws from. Default processed.
    pub logprobs_kind: LogprobsKind,
}

/// The most samples one row may draw ([`SamplingParams::n`]).
pub const MAX_N: usize = 1024;

/// Which distribution reported log-probabilities come from (vLLM's `logprobs_mode`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum LogprobsKind {
    /// `log_softmax` of the row as given, before any constraint, bias, penalty, temperature or
    /// filter (spec step 2). For probability input, `ln(p_i / sum p)`.
    Raw,
    /// The log of the final distribution of [`crate::distribution`]: `-inf` for removed
    /// tokens; greedy is one-hot (0 for the chosen token).
    #[default]
    Processed,
}

impl LogprobsKind {
    /// `"raw"` or `"processed"`.
    pub fn as_str(self) -> &'static str {
        match self {
            LogprobsKind::Raw => "raw",
            LogprobsKind::Processed => "processed",
        }
    }
}

impl Default for SamplingParams {
    fn default() -> Self {
        Self {
            temperature: 1.0,
            top_k: 0,
            top_p: 1.0,
            repetition_penalty: 1.0,
            min_p: 0.0,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            logit_bias: BTreeMap::new(),
            allowed_token_ids: None,
            bad_words: Vec::new(),
            min_tokens: 0,
            seed: None,
            n: 1,
            logprobs: None,
            logprobs_kind: LogprobsKind::Processed,
        }
    }
}

impl SamplingParams {
    /// Greedy decoding: temperature 0, everything else off.
    pub fn greedy() -> Self {
        Self {
            temperature: 0.0,
            ..Self::default()
        }
    }

    /// Whether these parameters choose the argmax (temperature below 1e-5).
    pub fn is_greedy(&self) -> bool {
        self.temperature < GREEDY_TEMPERATURE
    }

    /// Checks every field against its allowed range.
    ///
    /// # Errors
    /// [`ParamError`] naming the first field out of range, its value and the allowed range.
    /// Nothing is clamped.
    pub fn validate(&self) -> Result<(), ParamError> {
        if !(self.temperature >= 0.0 && self.temperature.is_finite()) {
            return Err(ParamError::new(
                "temperature",
                self.temperature,
                "a finite number >= 0",
            ));
        }
        if self.top_k < -1 {
            return Err(ParamError::new(
                "top_k",
                self.top_k,
                ">= 0 (0 or -1 disables it)",
            ));
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return Err(ParamError::new("top_p", self.top_p, "(0, 1]"));
        }
        if !(self.repetition_penalty > 0.0 && self.repetition_penalty.is_finite()) {
            return Err(ParamError::new(
                "repetition_penalty",
                self.repetition_penalty,
                "a finite number > 0 (1 disables it)",
            ));
        }
        if !(0.0..=1.0).contains(&self.min_p) {
            return Err(ParamError::new("min_p", self.min_p, "[0, 1]"));
        }
        for (field, value) in [
            ("presence_penalty", self.presence_penalty),
            ("frequency_penalty", self.frequency_penalty),
        ] {
            if !(-2.0..=2.0).contains(&value) {
                return Err(ParamError::new(field, value, "[-2, 2]"));
            }
        }
        if let Some((id, bias)) = self.logit_bias.iter().find(|(_, b)| !b.is_finite()) {
            return Err(ParamError::new(
                "logit_bias",
                format!("{bias} for token {id}"),
                "finite numbers (clamped to [-100, 100])",
            ));
        }
        if self.allowed_token_ids.as_ref().is_some_and(Vec::is_empty) {
            return Err(ParamError::new(
                "allowed_token_ids",
                "[]",
                "at least one token id, or none (all allowed)",
            ));
        }
        if self.bad_words.iter().any(Vec::is_empty) {
            return Err(ParamError::new(
                "bad_words",
                "an empty sequence",
                "non-empty token sequences",
            ));
        }
        if !(1..=MAX_N).contains(&self.n) {
            return Err(ParamError::new("n", self.n, "1..=1024"));
        }
        Ok(())
    }

    /// The token ids these parameters name (logit_bias keys, allowed ids, bad words), for a
    /// range check against the vocabulary: `(field, id)` pairs.
    pub(crate) fn named_ids(&self) -> impl Iterator<Item = (&'static str, u32)> + '_ {
        let bias = self.logit_bias.keys().map(|&id| ("logit_bias", id));
        let allowed = self
            .allowed_token_ids
            .iter()
            .flatten()
            .map(|&id| ("allowed_token_ids", id));
        let bad = self.bad_words.iter().flatten().map(|&id| ("bad_words", id));
        bias.chain(allowed).chain(bad)
    }
}
