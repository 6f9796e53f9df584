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
/// The order in which the parameters act is fixed (spec/sampling.md, "Order of operations"
/// and "Extended processors in the fixed path"): hard constraints (`allowed_token_ids`,
/// `bad_words`, `min_tokens`), `logit_bias`, 4a `sequence_bias`, repetition penalty,
/// frequency and presence penalties, 5a DRY, 5b `no_repeat_ngram_size`, temperature (or
/// greedy; the dynamic temperature replaces it when `dynatemp_range > 0`), `min_p`, `top_k`,
/// `top_p`, 10a `typical_p`, 10b `top_n_sigma`, 10c `epsilon_cutoff`, 10d `eta_cutoff`,
/// 10e XTC, then selection; `mirostat` 1 or 2 replaces `min_p` through selection. `min_keep`
/// applies to every filter from `min_p` to XTC. Requests that use none of the extended fields
/// run on the fused fast path; the others on the equivalent processor chain
/// ([`crate::SamplerChain::from_params`]), with the same results.
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

    // --- Extended processors (spec/sampling.md, "Extended processors in the fixed path") ---
    /// Step 4a, multi-token biases (Hugging Face's `SequenceBiasLogitsProcessor`, chain entry
    /// `sequence_bias`): `(sequence, bias)`; a one-token sequence's bias is always added, a
    /// longer one's is added to its last token when prompt + generated ids end with the rest.
    /// Sequences must be non-empty, biases finite. Default empty.
    pub sequence_bias: Vec<(Vec<u32>, f64)>,
    /// Step 5a, DRY's multiplier (llama.cpp's `dry_multiplier`, chain entry `dry`): `>= 0`,
    /// finite; 0 is off. Default 0.
    pub dry_multiplier: f64,
    /// DRY's base (`dry_base`): finite, `>= 1`. Default 1.75.
    pub dry_base: f64,
    /// DRY's allowed length (`dry_allowed_length`): repeats up to this long are not penalised.
    /// Default 2.
    pub dry_allowed_length: usize,
    /// DRY's window (`dry_penalty_last_n`): how many of the last tokens (prompt included) are
    /// scanned; -1 the whole sequence, 0 off. `>= -1`. Default -1.
    pub dry_penalty_last_n: i64,
    /// DRY's sequence breakers as token-id sequences (`dry_sequence_breakers`; a caller with a
    /// tokenizer resolves llama.cpp's strings, default `["\n", ":", "\"", "*"]`, with
    /// [`crate::chain::resolve_sequence_breakers`]). Sequences must be non-empty. Default empty.
    pub dry_sequence_breakers: Vec<Vec<u32>>,
    /// Step 5b, Hugging Face's `no_repeat_ngram_size` (chain entry `no_repeat_ngram`): a token
    /// that would complete an n-gram already in prompt + generated ids is banned. 0 is off.
    /// Default 0.
    pub no_repeat_ngram_size: usize,
    /// Step 7, dynamic temperature (llama.cpp `temp_ext`, chain entry `dynatemp`): when `> 0`
    /// the temperature is taken from `[max(0, T - range), T + range]` by the normalised entropy
    /// of the row. Finite, `>= 0`; 0 is off. Default 0.
    pub dynatemp_range: f64,
    /// The exponent of the dynamic temperature's entropy mapping (`dynatemp_exponent`):
    /// finite, `>= 0`. Default 1.
    pub dynatemp_exponent: f64,
    /// Step 10a, locally typical sampling (`typical_p`; llama.cpp `typical`): `(0, 1]`; 1 is off.
    /// Default 1.
    pub typical_p: f64,
    /// Step 10b, top-n-sigma (`top_n_sigma`; llama.cpp): keep logits `>= max - n * std`.
    /// Finite; `<= 0` is off (llama.cpp's default -1). Default -1.
    pub top_n_sigma: f64,
    /// Step 10c, epsilon sampling (Hugging Face's `epsilon_cutoff`): remove tokens with
    /// probability below it. `[0, 1)`; 0 is off. Default 0.
    pub epsilon_cutoff: f64,
    /// Step 10d, eta sampling (Hugging Face's `eta_cutoff`): `[0, 1)`; 0 is off. Default 0.
    pub eta_cutoff: f64,
    /// Step 10e, XTC's threshold (llama.cpp's `xtc_threshold`): `[0, 1]`; above 0.5 XTC does
    /// nothing (llama.cpp). Default 0.1.
    pub xtc_threshold: f64,
    /// XTC's probability (`xtc_probability`): `[0, 1]`; 0 is off. Its coin is drawn from the
    /// request's stream with counter word 3 = 1. Default 0.
    pub xtc_probability: f64,
    /// The fewest tokens every filter of steps 8-10e keeps (Hugging Face's
    /// `min_tokens_to_keep`, llama.cpp's `min_keep`): `>= 1`. Default 1.
    pub min_keep: usize,
    /// Mirostat (llama.cpp's `mirostat`): 0 off, 1 (Basu et al. 2021, v1) or 2 (v2). When on it
    /// replaces steps 8-11 (mirostat is the selection), its `mu` carried per request
    /// ([`crate::SampleRequest::mirostat_mu`], [`crate::SampleOutput::mirostat_mu`]). Default 0.
    pub mirostat: u8,
    /// Mirostat's target surprise (`mirostat_tau`): finite, `>= 0`. Default 5.
    pub mirostat_tau: f64,
    /// Mirostat's learning rate (`mirostat_eta`): finite, `>= 0`. Default 0.1.
    pub mirostat_eta: f64,
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
            sequence_bias: Vec::new(),
            dry_multiplier: 0.0,
            dry_base: 1.75,
            dry_allowed_length: 2,
            dry_penalty_last_n: -1,
            dry_sequence_breakers: Vec::new(),
            no_repeat_ngram_size: 0,
            dynatemp_range: 0.0,
            dynatemp_exponent: 1.0,
            typical_p: 1.0,
            top_n_sigma: -1.0,
            epsilon_cutoff: 0.0,
            eta_cutoff: 0.0,
            xtc_threshold: 0.1,
            xtc_probability: 0.0,
            min_keep: 1,
            mirostat: 0,
            mirostat_tau: 5.0,
            mirostat_eta: 0.1,
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
        self.validate_extended()
    }

    /// The ranges of the extended fields (spec/sampling.md, "Extended processors").
    fn validate_extended(&self) -> Result<(), ParamError> {
        if let Some((seq, bias)) = self
            .sequence_bias
            .iter()
            .find(|(seq, bias)| seq.is_empty() || !bias.is_finite())
        {
            return Err(ParamError::new(
                "sequence_bias",
                format!("{bias} for {seq:?}"),
                "non-empty token sequences with finite biases",
            ));
        }
        let finite_at_least = |field: &'static str, v: f64, lo: f64, range: &'static str| {
            if v.is_finite() && v >= lo {
                Ok(())
            } else {
                Err(ParamError::new(field, v, range))
            }
        };
        finite_at_least(
            "dry_multiplier",
            self.dry_multiplier,
            0.0,
            "a finite number >= 0 (0 disables DRY)",
        )?;
        finite_at_least("dry_base", self.dry_base, 1.0, "a finite number >= 1")?;
        if self.dry_penalty_last_n < -1 {
            return Err(ParamError::new(
                "dry_penalty_last_n",
                self.dry_penalty_last_n,
                ">= -1 (-1: the whole sequence, 0: off)",
            ));
        }
        if self.dry_sequence_breakers.iter().any(Vec::is_empty) {
            return Err(ParamError::new(
                "dry_sequence_breakers",
                "an empty sequence",
                "non-empty token sequences",
            ));
        }
        finite_at_least(
            "dynatemp_range",
            self.dynatemp_range,
            0.0,
            "a finite number >= 0 (0 disables it)",
        )?;
        finite_at_least(
            "dynatemp_exponent",
            self.dynatemp_exponent,
            0.0,
            "a finite number >= 0",
        )?;
        if !(self.typical_p > 0.0 && self.typical_p <= 1.0) {
            return Err(ParamError::new("typical_p", self.typical_p, "(0, 1]"));
        }
        if !self.top_n_sigma.is_finite() {
            return Err(ParamError::new(
                "top_n_sigma",
                self.top_n_sigma,
                "a finite number (<= 0 disables it)",
            ));
        }
        for (field, v) in [
            ("epsilon_cutoff", self.epsilon_cutoff),
            ("eta_cutoff", self.eta_cutoff),
        ] {
            if !(0.0..1.0).contains(&v) {
                return Err(ParamError::new(field, v, "[0, 1) (0 disables it)"));
            }
        }
        for (field, v) in [
            ("xtc_threshold", self.xtc_threshold),
            ("xtc_probability", self.xtc_probability),
        ] {
            if !(0.0..=1.0).contains(&v) {
                return Err(ParamError::new(field, v, "[0, 1]"));
            }
        }
        if self.min_keep == 0 {
            return Err(ParamError::new("min_keep", 0, ">= 1"));
        }
        if self.mirostat > 2 {
            return Err(ParamError::new(
                "mirostat",
                self.mirostat,
                "0 (off), 1 or 2",
            ));
        }
        finite_at_least(
            "mirostat_tau",
            self.mirostat_tau,
            0.0,
            "a finite number >= 0",
        )?;
        finite_at_least(
            "mirostat_eta",
            self.mirostat_eta,
            0.0,
            "a finite number >= 0",
        )?;
        Ok(())
    }

    /// Whether any extended field (spec/sampling.md, "Extended processors in the fixed path")
    /// is on, or `min_keep > 1`: such requests run on the processor chain
    /// ([`crate::SamplerChain::from_params`]) instead of the fused fast path.
    pub fn uses_extended(&self) -> bool {
        !self.sequence_bias.is_empty()
            || self.dry_enabled()
            || self.no_repeat_ngram_size > 0
            || self.dynatemp_range > 0.0
            || self.typical_p < 1.0
            || self.top_n_sigma > 0.0
            || self.epsilon_cutoff > 0.0
            || self.eta_cutoff > 0.0
            || (self.xtc_probability > 0.0 && self.xtc_threshold <= 0.5)
            || self.min_keep > 1
            || self.mirostat != 0
    }

    /// Whether DRY acts: a multiplier above 0 and a window that is not 0.
    pub(crate) fn dry_enabled(&self) -> bool {
        self.dry_multiplier > 0.0 && self.dry_penalty_last_n != 0
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
        let seq = self
            .sequence_bias
            .iter()
            .flat_map(|(s, _)| s)
            .map(|&id| ("sequence_bias", id));
        let breakers = self
            .dry_sequence_breakers
            .iter()
            .flatten()
            .map(|&id| ("dry_sequence_breakers", id));
        bias.chain(allowed).chain(bad).chain(seq).chain(breakers)
    }
}
