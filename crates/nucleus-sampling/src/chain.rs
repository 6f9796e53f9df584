//! Processor chains: each step of the fixed `SamplingParams` path as a processor of its own,
//! composed in any order and ended by a selection step, like llama.cpp's sampler chain
//! (`llama_sampler_chain_init` / `llama_sampler_chain_add`, `llama_sampler_i`'s apply / accept
//! / reset / clone).
//!
//! A [`SamplerChain`] is an ordered list of [`LogitsProcessor`]s followed by one
//! [`Selection`] (sample or greedy). For one row of logits it
//! 1. checks the context ids and every processor's token ids against the vocabulary
//!    ([`SampleError::TokenIdOutOfRange`]) and the row itself (a NaN or +inf logit is
//!    [`SampleError::NonFiniteLogits`], spec/sampling.md step 1),
//! 2. copies the row into its own buffer (the caller's logits are never written) and runs the
//!    processors on it in order; a processor removes a token by writing `-inf`,
//! 3. fails with [`SampleError::NoCandidates`] when every logit is `-inf` (step 12),
//! 4. selects: greedy takes the argmax (ties to the lowest id); sample forms the weights
//!    `exp(l - max)` in f32 and draws by inverse CDF in token-id order (step 11) with uniforms
//!    from the request's Philox stream.
//!
//! [`SamplerChain::from_params`] builds the one fixed chain of spec/sampling.md steps 3-11 and
//! matches [`crate::sample_row`] and [`crate::distribution`] (the fast path) within rounding.
//! [`SamplerChain::from_config`] builds a chain from data: a list of [`ProcessorConfig`],
//! serde-(de)serialisable, e.g. from JSON:
//!
//! ```
//! use nucleus_sampling::chain::{ProcessorConfig, ProcessorContext, SamplerChain};
//!
//! let json = r#"[{"top_k": {"k": 2}}, {"temperature": {"t": 0.7}}, {"sample": {"seed": 42}}]"#;
//! let config: Vec<ProcessorConfig> = serde_json::from_str(json).unwrap();
//! let mut chain = SamplerChain::from_config(&config).unwrap();
//!
//! let prompt = [3u32, 1];
//! let mut output = Vec::new();
//! chain.reset(&prompt);
//! let logits = [0.5f32, 2.0, 1.0, -1.0];
//! for step in 0..3u64 {
//!     let ctx = ProcessorContext::new(&prompt, &output, prompt.len() as u64 + step);
//!     let sampled = chain.sample(&logits, &ctx, 0).unwrap();
//!     assert!(sampled.token == 1 || sampled.token == 2); // top_k 2 keeps ids 1 and 2
//!     chain.accept(sampled.token);
//!     output.push(sampled.token);
//! }
//! ```
//!
//! Stateful processors ([`RepetitionPenalty`], [`FrequencyPresencePenalty`]) learn the
//! sequence through [`LogitsProcessor::reset`] (the prompt) and [`LogitsProcessor::accept`]
//! (each committed token), not from the context, and clone their state: a cloned chain (a fork
//! for beam search or speculative decoding) continues independently.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::fmt;

use serde::{Deserialize, Serialize};

use crate::error::{ParamError, SampleError};
use crate::kernels;
use crate::params::{LogprobsKind, GREEDY_TEMPERATURE, LOGIT_BIAS_LIMIT, MAX_N};
use crate::philox;
use crate::sampler::{
    chunked_sum, dense_top_logprobs, non_finite, os_seed, processed_logprobs_from, raw_logprobs,
    select_dense, Logprobs, Sample, SampleOutput, TokenLogprob,
};
use crate::view::InputKind;

// ---------------------------------------------------------------------------------------------
// Context and trait
// ---------------------------------------------------------------------------------------------

/// The context of one decode step of one request, as a processor sees it.
///
/// Every id must be below the row's vocabulary size (the length of the logits row given to
/// [`SamplerChain::sample`]); the chain checks them ([`SampleError::TokenIdOutOfRange`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ProcessorContext<'a> {
    /// The prompt's token ids.
    pub prompt_ids: &'a [u32],
    /// The token ids generated so far (`bad_words` and `min_tokens` read them; the penalties
    /// keep their own state through [`LogitsProcessor::accept`]).
    pub output_ids: &'a [u32],
    /// EOS and stop token ids ([`MinTokens`] bans them until enough tokens were generated).
    pub stop_token_ids: &'a [u32],
    /// Index, in the whole sequence (prompt included), of the token being chosen: the Philox
    /// counter's position words (spec/sampling.md, "Random streams").
    pub position: u64,
    /// A structured-output token bitmask row ([`crate::bitmask`] layout, at least
    /// `ceil(vocab_size / 32)` words), applied by the chain before its processors: a hard
    /// constraint of step 3, which commutes with the others (a masked `-inf` stays `-inf`
    /// through bias and penalties). `None`: no mask.
    pub token_bitmask: Option<&'a [u32]>,
}

impl<'a> ProcessorContext<'a> {
    /// A context without stop ids.
    pub fn new(prompt_ids: &'a [u32], output_ids: &'a [u32], position: u64) -> Self {
        Self {
            prompt_ids,
            output_ids,
            stop_token_ids: &[],
            position,
            token_bitmask: None,
        }
    }

    /// The same context with this token bitmask row.
    pub fn with_token_bitmask(mut self, bitmask: &'a [u32]) -> Self {
        self.token_bitmask = Some(bitmask);
        self
    }

    /// The same context with these EOS and stop ids.
    pub fn with_stop_token_ids(mut self, stop_token_ids: &'a [u32]) -> Self {
        self.stop_token_ids = stop_token_ids;
        self
    }
}

/// One step of a [`SamplerChain`]: modifies one row of logits in place (llama.cpp's
/// `llama_sampler_i`: apply, accept, reset, clone).
///
/// Implement it to add your own processor; push it with [`SamplerChain::push`]. A processor
/// removes a token by writing `-inf`; it must not write NaN or `+inf` (the chain reports
/// [`SampleError::NonFiniteLogits`] if it does).
///
/// ```
/// use nucleus_sampling::chain::{LogitsProcessor, ProcessorContext, SamplerChain, Selection};
/// use nucleus_sampling::SampleError;
///
/// /// Bans odd token ids.
/// #[derive(Clone, Debug)]
/// struct EvenOnly;
///
/// impl LogitsProcessor for EvenOnly {
///     fn name(&self) -> &str {
///         "even_only"
///     }
///     fn apply(&mut self, logits: &mut [f32], _ctx: &ProcessorContext<'_>) -> Result<(), SampleError> {
///         logits.iter_mut().skip(1).step_by(2).for_each(|l| *l = f32::NEG_INFINITY);
///         Ok(())
///     }
///     fn box_clone(&self) -> Box<dyn LogitsProcessor> {
///         Box::new(self.clone())
///     }
/// }
///
/// let mut chain = SamplerChain::new(Selection::greedy());
/// chain.push(EvenOnly);
/// let out = chain.sample(&[0.0, 5.0, 1.0], &ProcessorContext::default(), 0).unwrap();
/// assert_eq!(out.token, 2);
/// ```
pub trait LogitsProcessor: Send + Sync + fmt::Debug {
    /// A short name, snake_case (the [`ProcessorConfig`] name for the built-in processors).
    fn name(&self) -> &str;

    /// Modifies `logits` in place: one row of `vocab_size = logits.len()` f32 logits, already
    /// checked free of NaN and `+inf`. Writing `-inf` removes a token.
    ///
    /// # Errors
    /// Any [`SampleError`]; the chain stops and returns it for this row.
    fn apply(&mut self, logits: &mut [f32], ctx: &ProcessorContext<'_>) -> Result<(), SampleError>;

    /// A new request starts: clear any state, then take the prompt ids into account.
    /// Default: nothing.
    fn reset(&mut self, _prompt_ids: &[u32]) {}

    /// A token was committed to the sequence. Default: nothing.
    fn accept(&mut self, _token: u32) {}

    /// Checks the token ids this processor holds (configuration and state) against the
    /// vocabulary size; the chain calls it before the row check. Default: nothing to check.
    ///
    /// # Errors
    /// [`SampleError::TokenIdOutOfRange`] naming the field and the id.
    fn check_ids(&self, _vocab_size: usize) -> Result<(), SampleError> {
        Ok(())
    }

    /// A boxed copy, state included (how `Box<dyn LogitsProcessor>` implements `Clone`).
    fn box_clone(&self) -> Box<dyn LogitsProcessor>;
}

impl Clone for Box<dyn LogitsProcessor> {
    fn clone(&self) -> Self {
        self.box_clone()
    }
}

/// The first id of `ids` not below `vocab_size`, as an error naming `field`.
fn check_range<'a>(
    field: &'static str,
    ids: impl IntoIterator<Item = &'a u32>,
    vocab_size: usize,
) -> Result<(), SampleError> {
    match ids.into_iter().find(|&&id| id as usize >= vocab_size) {
        Some(&token_id) => Err(SampleError::TokenIdOutOfRange {
            field,
            token_id,
            vocab_size,
        }),
        None => Ok(()),
    }
}

fn row_max(values: &[f32]) -> f32 {
    kernels::max_bad(values).0
}

/// The filtering order: larger logit first, then lower id (spec steps 9-10). Logits are
/// stored with `-0.0` turned into `0.0`, so `total_cmp` agrees with `==` on them.
#[inline]
fn better(a: &(f32, u32), b: &(f32, u32)) -> std::cmp::Ordering {
    b.0.total_cmp(&a.0).then(a.1.cmp(&b.1))
}

// ---------------------------------------------------------------------------------------------
// Hard constraints (step 3)
// ---------------------------------------------------------------------------------------------

/// Only these ids may be chosen: every other logit becomes `-inf` (spec step 3; vLLM's
/// `allowed_token_ids`). Stateless. O(vocab) per row.
#[derive(Clone, Debug, PartialEq)]
pub struct AllowedTokenIds {
    /// Sorted, without duplicates.
    ids: Vec<u32>,
}

impl AllowedTokenIds {
    /// Allows exactly `ids` (any order, duplicates ignored).
    ///
    /// # Errors
    /// [`ParamError`] for `allowed_token_ids` when `ids` is empty. Ids at or above the
    /// vocabulary size are reported when the chain runs ([`SampleError::TokenIdOutOfRange`]).
    pub fn new(mut ids: Vec<u32>) -> Result<Self, ParamError> {
        if ids.is_empty() {
            return Err(ParamError::new(
                "allowed_token_ids",
                "[]",
                "at least one token id, or none (all allowed)",
            ));
        }
        ids.sort_unstable();
        ids.dedup();
        Ok(Self { ids })
    }

    /// The allowed ids, ascending.
    pub fn ids(&self) -> &[u32] {
        &self.ids
    }
}

impl LogitsProcessor for AllowedTokenIds {
    fn name(&self) -> &str {
        "allowed_token_ids"
    }
    fn apply(
        &mut self,
        logits: &mut [f32],
        _ctx: &ProcessorContext<'_>,
    ) -> Result<(), SampleError> {
        self.check_ids(logits.len())?;
        let mut next = self.ids.iter().peekable();
        for (i, l) in logits.iter_mut().enumerate() {
            if next.peek() == Some(&&(i as u32)) {
                next.next();
            } else {
                *l = f32::NEG_INFINITY;
            }
        }
        Ok(())
    }
    fn check_ids(&self, vocab_size: usize) -> Result<(), SampleError> {
        check_range("allowed_token_ids", self.ids.last(), vocab_size)
    }
    fn box_clone(&self) -> Box<dyn LogitsProcessor> {
        Box::new(self.clone())
    }
}

/// Banned token sequences (spec step 3; vLLM's `bad_words` as token ids): the last token of a
/// sequence becomes `-inf` when the generated ids ([`ProcessorContext::output_ids`]) end with
/// the rest of it; a one-token sequence is always banned. Stateless.
#[derive(Clone, Debug, PartialEq)]
pub struct BadWords {
    words: Vec<Vec<u32>>,
}

impl BadWords {
    /// Bans `words`.
    ///
    /// # Errors
    /// [`ParamError`] for `bad_words` when a sequence is empty.
    pub fn new(words: Vec<Vec<u32>>) -> Result<Self, ParamError> {
        if words.iter().any(Vec::is_empty) {
            return Err(ParamError::new(
                "bad_words",
                "an empty sequence",
                "non-empty token sequences",
            ));
        }
        Ok(Self { words })
    }

    /// The banned sequences.
    pub fn words(&self) -> &[Vec<u32>] {
        &self.words
    }
}

impl LogitsProcessor for BadWords {
    fn name(&self) -> &str {
        "bad_words"
    }
    fn apply(&mut self, logits: &mut [f32], ctx: &ProcessorContext<'_>) -> Result<(), SampleError> {
        self.check_ids(logits.len())?;
        for word in &self.words {
            if let Some((&last, prefix)) = word.split_last() {
                if ctx.output_ids.ends_with(prefix) {
                    logits[last as usize] = f32::NEG_INFINITY;
                }
            }
        }
        Ok(())
    }
    fn check_ids(&self, vocab_size: usize) -> Result<(), SampleError> {
        check_range("bad_words", self.words.iter().flatten(), vocab_size)
    }
    fn box_clone(&self) -> Box<dyn LogitsProcessor> {
        Box::new(self.clone())
    }
}

/// Bans the EOS and stop ids ([`ProcessorContext::stop_token_ids`]) while fewer than
/// `min_tokens` tokens have been generated (`ctx.output_ids.len() < min_tokens`; spec step 3,
/// vLLM's `min_tokens`). Stateless. 0 is off.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MinTokens {
    min_tokens: usize,
}

impl MinTokens {
    /// Bans the stop ids until `min_tokens` tokens were generated. Every value is valid.
    pub fn new(min_tokens: usize) -> Self {
        Self { min_tokens }
    }

    /// The minimum number of generated tokens.
    pub fn min_tokens(&self) -> usize {
        self.min_tokens
    }
}

impl LogitsProcessor for MinTokens {
    fn name(&self) -> &str {
        "min_tokens"
    }
    fn apply(&mut self, logits: &mut [f32], ctx: &ProcessorContext<'_>) -> Result<(), SampleError> {
        if ctx.output_ids.len() < self.min_tokens {
            check_range("stop_token_ids", ctx.stop_token_ids, logits.len())?;
            for &id in ctx.stop_token_ids {
                logits[id as usize] = f32::NEG_INFINITY;
            }
        }
        Ok(())
    }
    fn box_clone(&self) -> Box<dyn LogitsProcessor> {
        Box::new(self.clone())
    }
}

// ---------------------------------------------------------------------------------------------
// Bias (step 4) and penalties (step 5)
// ---------------------------------------------------------------------------------------------

/// Adds a bias to the logits of some ids: `l = (l as f64 + bias) as f32`, each bias clamped to
/// `[-100, 100]` (spec step 4; OpenAI's and vLLM's `logit_bias`). `-inf` stays `-inf`.
/// Stateless.
#[derive(Clone, Debug, PartialEq)]
pub struct LogitBias {
    /// (id, clamped bias), ascending id.
    bias: Vec<(u32, f64)>,
}

impl LogitBias {
    /// Biases by token id; values are clamped to `[-100, 100]` ([`LOGIT_BIAS_LIMIT`]).
    ///
    /// # Errors
    /// [`ParamError`] for `logit_bias` when a value is NaN or infinite.
    pub fn new(bias: BTreeMap<u32, f64>) -> Result<Self, ParamError> {
        if let Some((id, b)) = bias.iter().find(|(_, b)| !b.is_finite()) {
            return Err(ParamError::new(
                "logit_bias",
                format!("{b} for token {id}"),
                "finite numbers (clamped to [-100, 100])",
            ));
        }
        Ok(Self {
            bias: bias
                .into_iter()
                .map(|(id, b)| (id, b.clamp(-LOGIT_BIAS_LIMIT, LOGIT_BIAS_LIMIT)))
                .collect(),
        })
    }

    /// The (id, clamped bias) pairs, ascending id.
    pub fn bias(&self) -> &[(u32, f64)] {
        &self.bias
    }
}

impl LogitsProcessor for LogitBias {
    fn name(&self) -> &str {
        "logit_bias"
    }
    fn apply(
        &mut self,
        logits: &mut [f32],
        _ctx: &ProcessorContext<'_>,
    ) -> Result<(), SampleError> {
        self.check_ids(logits.len())?;
        for &(id, b) in &self.bias {
            let l = &mut logits[id as usize];
            *l = (f64::from(*l) + b) as f32;
        }
        Ok(())
    }
    fn check_ids(&self, vocab_size: usize) -> Result<(), SampleError> {
        check_range("logit_bias", self.bias.iter().map(|(id, _)| id), vocab_size)
    }
    fn box_clone(&self) -> Box<dyn LogitsProcessor> {
        Box::new(self.clone())
    }
}

/// The repetition penalty over the distinct ids of the prompt and the accepted tokens:
/// `l > 0 ? l / r : l * r` in f32, each distinct id once (spec step 5; CTRL, Keskar et al.
/// 2019; Hugging Face's `RepetitionPenaltyLogitsProcessor`). 1 is off.
///
/// Stateful: [`LogitsProcessor::reset`] takes the prompt ids, [`LogitsProcessor::accept`] each
/// committed token; the context's ids are not read. Cloning copies the state.
#[derive(Clone, Debug)]
pub struct RepetitionPenalty {
    penalty: f64,
    /// Distinct ids seen, in first-seen order (prompt first).
    ids: Vec<u32>,
    seen: HashSet<u32>,
    /// The largest prompt id and accepted id, for the range check.
    max_prompt: Option<u32>,
    max_output: Option<u32>,
}

impl RepetitionPenalty {
    /// A penalty `r`.
    ///
    /// # Errors
    /// [`ParamError`] for `repetition_penalty` unless `r` is finite and `> 0`.
    pub fn new(penalty: f64) -> Result<Self, ParamError> {
        if !(penalty > 0.0 && penalty.is_finite()) {
            return Err(ParamError::new(
                "repetition_penalty",
                penalty,
                "a finite number > 0 (1 disables it)",
            ));
        }
        Ok(Self {
            penalty,
            ids: Vec::new(),
            seen: HashSet::new(),
            max_prompt: None,
            max_output: None,
        })
    }

    /// The penalty.
    pub fn penalty(&self) -> f64 {
        self.penalty
    }

    /// The distinct ids seen so far (prompt and accepted tokens), in first-seen order.
    pub fn seen_ids(&self) -> &[u32] {
        &self.ids
    }

    fn insert(&mut self, id: u32) {
        if self.seen.insert(id) {
            self.ids.push(id);
        }
    }
}

impl LogitsProcessor for RepetitionPenalty {
    fn name(&self) -> &str {
        "repetition_penalty"
    }
    /// # Errors
    /// [`SampleError::PenaltyOverflow`] when `l / r` or `l * r` leaves the f32 range.
    fn apply(
        &mut self,
        logits: &mut [f32],
        _ctx: &ProcessorContext<'_>,
    ) -> Result<(), SampleError> {
        self.check_ids(logits.len())?;
        if self.penalty == 1.0 {
            return Ok(());
        }
        let r = self.penalty as f32;
        for &id in &self.ids {
            let l = &mut logits[id as usize];
            let before = *l;
            *l = if before > 0.0 { before / r } else { before * r };
            if before.is_finite() && !l.is_finite() {
                return Err(SampleError::PenaltyOverflow {
                    token_id: id,
                    logit: before,
                    penalty: self.penalty,
                });
            }
        }
        Ok(())
    }
    fn reset(&mut self, prompt_ids: &[u32]) {
        self.ids.clear();
        self.seen.clear();
        self.max_output = None;
        self.max_prompt = prompt_ids.iter().copied().max();
        for &id in prompt_ids {
            self.insert(id);
        }
    }
    fn accept(&mut self, token: u32) {
        self.max_output = self.max_output.max(Some(token));
        self.insert(token);
    }
    fn check_ids(&self, vocab_size: usize) -> Result<(), SampleError> {
        check_range("prompt_ids", &self.max_prompt, vocab_size)?;
        check_range("output_ids", &self.max_output, vocab_size)
    }
    fn box_clone(&self) -> Box<dyn LogitsProcessor> {
        Box::new(self.clone())
    }
}

/// Frequency and presence penalties over the accepted tokens (prompt ids do not count):
/// `l = (l as f64 - (count * frequency + presence)) as f32` for every id accepted `count > 0`
/// times (spec step 5; OpenAI's definitions). Both 0 is off.
///
/// One processor for both, so that the fixed chain rounds once as the fast path does; the
/// config entries `frequency_penalty` and `presence_penalty` each build one with the other
/// penalty 0 ([`Self::frequency`], [`Self::presence`]).
///
/// Stateful: counts come from [`LogitsProcessor::accept`]; [`LogitsProcessor::reset`] clears
/// them. Cloning copies the counts.
#[derive(Clone, Debug)]
pub struct FrequencyPresencePenalty {
    frequency: f64,
    presence: f64,
    name: &'static str,
    /// (id, count) in first-seen order.
    counts: Vec<(u32, u32)>,
    /// id -> index into `counts`.
    index: HashMap<u32, usize>,
    max_output: Option<u32>,
}

impl FrequencyPresencePenalty {
    /// Both penalties.
    ///
    /// # Errors
    /// [`ParamError`] for `frequency_penalty` or `presence_penalty` outside `[-2, 2]`.
    pub fn new(frequency: f64, presence: f64) -> Result<Self, ParamError> {
        for (field, value) in [
            ("frequency_penalty", frequency),
            ("presence_penalty", presence),
        ] {
            if !(-2.0..=2.0).contains(&value) {
                return Err(ParamError::new(field, value, "[-2, 2]"));
            }
        }
        Ok(Self {
            frequency,
            presence,
            name: "frequency_presence_penalty",
            counts: Vec::new(),
            index: HashMap::new(),
            max_output: None,
        })
    }

    /// The frequency penalty alone (named `frequency_penalty`).
    ///
    /// # Errors
    /// As [`Self::new`].
    pub fn frequency(frequency: f64) -> Result<Self, ParamError> {
        let mut p = Self::new(frequency, 0.0)?;
        p.name = "frequency_penalty";
        Ok(p)
    }

    /// The presence penalty alone (named `presence_penalty`).
    ///
    /// # Errors
    /// As [`Self::new`].
    pub fn presence(presence: f64) -> Result<Self, ParamError> {
        let mut p = Self::new(0.0, presence)?;
        p.name = "presence_penalty";
        Ok(p)
    }

    /// The number of times `token` was accepted since the last reset.
    pub fn count(&self, token: u32) -> u32 {
        self.index.get(&token).map_or(0, |&i| self.counts[i].1)
    }
}

impl LogitsProcessor for FrequencyPresencePenalty {
    fn name(&self) -> &str {
        self.name
    }
    fn apply(
        &mut self,
        logits: &mut [f32],
        _ctx: &ProcessorContext<'_>,
    ) -> Result<(), SampleError> {
        self.check_ids(logits.len())?;
        if self.frequency == 0.0 && self.presence == 0.0 {
            return Ok(());
        }
        for &(id, count) in &self.counts {
            let l = &mut logits[id as usize];
            *l = (f64::from(*l) - (f64::from(count) * self.frequency + self.presence)) as f32;
        }
        Ok(())
    }
    fn reset(&mut self, _prompt_ids: &[u32]) {
        self.counts.clear();
        self.index.clear();
        self.max_output = None;
    }
    fn accept(&mut self, token: u32) {
        self.max_output = self.max_output.max(Some(token));
        match self.index.get(&token) {
            Some(&i) => self.counts[i].1 += 1,
            None => {
                self.index.insert(token, self.counts.len());
                self.counts.push((token, 1));
            }
        }
    }
    fn check_ids(&self, vocab_size: usize) -> Result<(), SampleError> {
        check_range("output_ids", &self.max_output, vocab_size)
    }
    fn box_clone(&self) -> Box<dyn LogitsProcessor> {
        Box::new(self.clone())
    }
}

// ---------------------------------------------------------------------------------------------
// Temperature and filters (steps 7-10)
// ---------------------------------------------------------------------------------------------

/// Temperature: `l = (l - max) / T` in f32, the row maximum subtracted first so that no
/// finite `T` can overflow (spec step 7). Afterwards the maximum is 0. `-inf` stays `-inf`.
/// Stateless. For greedy decoding (T below 1e-5) use [`Selection::Greedy`].
#[derive(Clone, Debug, PartialEq)]
pub struct Temperature {
    t: f64,
}

impl Temperature {
    /// Temperature `t`.
    ///
    /// # Errors
    /// [`ParamError`] for `temperature` unless `t` is finite and `>= 1e-5`
    /// ([`GREEDY_TEMPERATURE`]); below it the fixed path is greedy, which here is the
    /// [`Selection::Greedy`] step.
    pub fn new(t: f64) -> Result<Self, ParamError> {
        if !(t >= GREEDY_TEMPERATURE && t.is_finite()) {
            return Err(ParamError::new(
                "temperature",
                t,
                "a finite number >= 1e-5 (for lower temperatures use the greedy selection)",
            ));
        }
        Ok(Self { t })
    }

    /// The temperature.
    pub fn t(&self) -> f64 {
        self.t
    }
}

impl LogitsProcessor for Temperature {
    fn name(&self) -> &str {
        "temperature"
    }
    fn apply(
        &mut self,
        logits: &mut [f32],
        _ctx: &ProcessorContext<'_>,
    ) -> Result<(), SampleError> {
        let max = row_max(logits);
        if max == f32::NEG_INFINITY {
            return Ok(());
        }
        let t = self.t as f32;
        for l in logits.iter_mut() {
            let d = *l - max;
            *l = if d == f32::NEG_INFINITY {
                if *l == f32::NEG_INFINITY {
                    f32::NEG_INFINITY
                } else {
                    // The difference of two finite logits left the f32 range: form it in f64.
                    ((f64::from(*l) - f64::from(max)) / self.t) as f32
                }
            } else {
                d / t
            };
        }
        Ok(())
    }
    fn box_clone(&self) -> Box<dyn LogitsProcessor> {
        Box::new(self.clone())
    }
}

/// Min-p: keeps the tokens whose probability is `>= min_p * p_max`, ties with the threshold
/// kept (spec step 8; Nguyen et al. 2024, vLLM, llama.cpp). The probabilities are the weights
/// `exp(l - max)` in f32 (so `p_max`'s weight is 1) and the decision `w >= min_p` is made in
/// f64. 0 is off. Stateless.
#[derive(Clone, Debug, PartialEq)]
pub struct MinP {
    p: f64,
}

impl MinP {
    /// Min-p `p`.
    ///
    /// # Errors
    /// [`ParamError`] for `min_p` outside `[0, 1]`.
    pub fn new(p: f64) -> Result<Self, ParamError> {
        if !(0.0..=1.0).contains(&p) {
            return Err(ParamError::new("min_p", p, "[0, 1]"));
        }
        Ok(Self { p })
    }

    /// The threshold.
    pub fn p(&self) -> f64 {
        self.p
    }
}

impl LogitsProcessor for MinP {
    fn name(&self) -> &str {
        "min_p"
    }
    fn apply(
        &mut self,
        logits: &mut [f32],
        _ctx: &ProcessorContext<'_>,
    ) -> Result<(), SampleError> {
        let max = row_max(logits);
        if self.p == 0.0 || max == f32::NEG_INFINITY {
            return Ok(());
        }
        for l in logits.iter_mut() {
            if *l != f32::NEG_INFINITY && f64::from((*l - max).exp()) < self.p {
                *l = f32::NEG_INFINITY;
            }
        }
        Ok(())
    }
    fn box_clone(&self) -> Box<dyn LogitsProcessor> {
        Box::new(self.clone())
    }
}

/// Top-k: keeps exactly the `k` largest logits, ties broken toward the lower token id
/// (spec step 9: exact-k, so `k = 1` is greedy). 0, -1 and `k >= vocab_size` are off; a row
/// with at most `k` finite logits is unchanged. Stateless; O(vocab) per row (a linear-time
/// selection in a buffer kept across calls).
#[derive(Clone, Debug)]
pub struct TopK {
    k: usize,
    buf: Vec<(f32, u32)>,
}

impl TopK {
    /// Top-k `k`.
    ///
    /// # Errors
    /// [`ParamError`] for `top_k` below -1 (`0` and `-1`, vLLM's legacy spelling, are off).
    pub fn new(k: i64) -> Result<Self, ParamError> {
        if k < -1 {
            return Err(ParamError::new("top_k", k, ">= 0 (0 or -1 disables it)"));
        }
        Ok(Self {
            k: usize::try_from(k.max(0)).unwrap_or(usize::MAX),
            buf: Vec::new(),
        })
    }

    /// `k` (0 when off).
    pub fn k(&self) -> usize {
        self.k
    }
}

impl LogitsProcessor for TopK {
    fn name(&self) -> &str {
        "top_k"
    }
    fn apply(
        &mut self,
        logits: &mut [f32],
        _ctx: &ProcessorContext<'_>,
    ) -> Result<(), SampleError> {
        let k = self.k;
        if k == 0 || k >= logits.len() {
            return Ok(());
        }
        self.buf.clear();
        self.buf.extend(
            logits
                .iter()
                .enumerate()
                .filter(|(_, &l)| l != f32::NEG_INFINITY)
                .map(|(i, &l)| (l + 0.0, i as u32)),
        );
        if self.buf.len() <= k {
            return Ok(());
        }
        let (_, &mut (kl, kid), _) = self.buf.select_nth_unstable_by(k - 1, better);
        for (i, l) in logits.iter_mut().enumerate() {
            if *l < kl || (*l == kl && i as u32 > kid) {
                *l = f32::NEG_INFINITY;
            }
        }
        Ok(())
    }
    fn box_clone(&self) -> Box<dyn LogitsProcessor> {
        Box::new(self.clone())
    }
}

/// Top-p (nucleus): keeps the shortest prefix, in the order (logit descending, id ascending),
/// whose renormalised mass is `>= p`; a prefix that reaches `p` exactly takes nothing more
/// (spec step 10, "smallest set"). Weights `exp(l - max)` in f32, sums in f64 (the total in
/// fixed id chunks). If rounding leaves every prefix below `p`, everything is kept. 1 is off.
/// Stateless; O(n log n) in the number `n` of finite logits (a sort in a buffer kept across
/// calls).
#[derive(Clone, Debug)]
pub struct TopP {
    p: f64,
    /// (logit, id, weight).
    buf: Vec<(f32, u32, f32)>,
}

impl TopP {
    /// Top-p `p`.
    ///
    /// # Errors
    /// [`ParamError`] for `top_p` outside `(0, 1]`.
    pub fn new(p: f64) -> Result<Self, ParamError> {
        if !(p > 0.0 && p <= 1.0) {
            return Err(ParamError::new("top_p", p, "(0, 1]"));
        }
        Ok(Self { p, buf: Vec::new() })
    }

    /// The mass to reach.
    pub fn p(&self) -> f64 {
        self.p
    }
}

impl LogitsProcessor for TopP {
    fn name(&self) -> &str {
        "top_p"
    }
    fn apply(
        &mut self,
        logits: &mut [f32],
        _ctx: &ProcessorContext<'_>,
    ) -> Result<(), SampleError> {
        let max = row_max(logits);
        if self.p >= 1.0 || max == f32::NEG_INFINITY {
            return Ok(());
        }
        self.buf.clear();
        self.buf.extend(
            logits
                .iter()
                .enumerate()
                .filter(|(_, &l)| l != f32::NEG_INFINITY)
                .map(|(i, &l)| (l + 0.0, i as u32, (l - max).exp())),
        );
        let z = chunked_sum(self.buf.iter().map(|c| (c.1 as usize, c.2)));
        let target = self.p * z;
        self.buf
            .sort_unstable_by(|a, b| better(&(a.0, a.1), &(b.0, b.1)));
        let mut acc = 0.0f64;
        let mut cut = self.buf.len();
        for (j, c) in self.buf.iter().enumerate() {
            acc += f64::from(c.2);
            if acc >= target {
                cut = j + 1;
                break;
            }
        }
        for c in &self.buf[cut..] {
            logits[c.1 as usize] = f32::NEG_INFINITY;
        }
        Ok(())
    }
    fn box_clone(&self) -> Box<dyn LogitsProcessor> {
        Box::new(self.clone())
    }
}

// ---------------------------------------------------------------------------------------------
// Selection and the chain
// ---------------------------------------------------------------------------------------------

/// The last step of a chain: how the token is chosen from the processed logits.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Selection {
    /// Inverse-CDF sampling in token-id order (spec step 11) from the weights `exp(l - max)`
    /// (f32), with `n` uniforms from Philox4x32-10 at `(seed, ctx.position, sample_index + j)`,
    /// `j in 0..n` ([`philox::uniform`]).
    Sample {
        /// The stream's seed; `None`: drawn from the OS on every call ([`crate::os_seed`]) and
        /// reported in [`SampleOutput::seed`]. An engine should draw it once per request.
        seed: Option<u64>,
        /// Samples per row from the one processed distribution, `1..=`[`MAX_N`].
        n: usize,
        /// Top log-probabilities to report, as [`crate::SamplingParams::logprobs`]; at most
        /// `vocab_size`.
        logprobs: Option<usize>,
        /// Which distribution the log-probabilities come from.
        logprobs_kind: LogprobsKind,
    },
    /// The argmax of the processed logits, ties to the lowest id (spec step 6); draws nothing,
    /// logprob 0, [`SampleOutput::seed`] 0.
    Greedy {
        /// Copies of the token in the output (as the fast path with `n > 1`), `1..=`[`MAX_N`].
        n: usize,
        /// Top log-probabilities to report (processed: one-hot).
        logprobs: Option<usize>,
        /// Which distribution the log-probabilities come from.
        logprobs_kind: LogprobsKind,
    },
}

impl Selection {
    /// One sample per row from the stream of `seed`, no logprobs.
    pub fn sample(seed: Option<u64>) -> Self {
        Selection::Sample {
            seed,
            n: 1,
            logprobs: None,
            logprobs_kind: LogprobsKind::Processed,
        }
    }

    /// Greedy, one token, no logprobs.
    pub fn greedy() -> Self {
        Selection::Greedy {
            n: 1,
            logprobs: None,
            logprobs_kind: LogprobsKind::Processed,
        }
    }

    /// Whether this is [`Selection::Greedy`].
    pub fn is_greedy(&self) -> bool {
        matches!(self, Selection::Greedy { .. })
    }

    /// The number of samples.
    pub fn n(&self) -> usize {
        match *self {
            Selection::Sample { n, .. } | Selection::Greedy { n, .. } => n,
        }
    }

    fn logprobs(&self) -> (Option<usize>, LogprobsKind) {
        match *self {
            Selection::Sample {
                logprobs,
                logprobs_kind,
                ..
            }
            | Selection::Greedy {
                logprobs,
                logprobs_kind,
                ..
            } => (logprobs, logprobs_kind),
        }
    }

    /// Checks `n`.
    ///
    /// # Errors
    /// [`ParamError`] for `n` outside `1..=1024`.
    pub fn validate(&self) -> Result<(), ParamError> {
        let n = self.n();
        if !(1..=MAX_N).contains(&n) {
            return Err(ParamError::new("n", n, "1..=1024"));
        }
        Ok(())
    }
}

/// An ordered list of [`LogitsProcessor`]s ending in a [`Selection`] (llama.cpp's sampler
/// chain; STYLE.md point 3). Cloning clones every processor with its state and the buffers.
///
/// The chain owns two buffers of `vocab_size` f32 values (the processed row and the weights),
/// reused across calls: once warm, [`Self::sample`] allocates only for `n > 1` or logprobs.
///
/// Rows: `logits` is one row of `vocab_size` f32 logits (the candidate part of a padded row,
/// e.g. [`crate::LogitsView::row`]); for 16-bit rows widen to f32 first.
///
/// A chain is itself a [`LogitsProcessor`] (its processors, without the selection), so chains
/// nest.
#[derive(Clone, Debug)]
pub struct SamplerChain {
    processors: Vec<Box<dyn LogitsProcessor>>,
    selection: Selection,
    logits: Vec<f32>,
    weights: Vec<f32>,
}

impl SamplerChain {
    /// An empty chain that selects with `selection`. The selection is checked when sampling
    /// ([`Selection::validate`]).
    pub fn new(selection: Selection) -> Self {
        Self {
            processors: Vec::new(),
            selection,
            logits: Vec::new(),
            weights: Vec::new(),
        }
    }

    /// Appends a processor (runs after the ones already there).
    pub fn push(&mut self, processor: impl LogitsProcessor + 'static) -> &mut Self {
        self.processors.push(Box::new(processor));
        self
    }

    /// Appends a boxed processor.
    pub fn push_boxed(&mut self, processor: Box<dyn LogitsProcessor>) -> &mut Self {
        self.processors.push(processor);
        self
    }

    /// Builder style [`Self::push`].
    pub fn with(mut self, processor: impl LogitsProcessor + 'static) -> Self {
        self.push(processor);
        self
    }

    /// The processors, in order.
    pub fn processors(&self) -> &[Box<dyn LogitsProcessor>] {
        &self.processors
    }

    /// The selection step.
    pub fn selection(&self) -> &Selection {
        &self.selection
    }

    /// Replaces the selection step.
    pub fn set_selection(&mut self, selection: Selection) {
        self.selection = selection;
    }

    /// The fixed chain of spec/sampling.md steps 3-11 for `params`: [`AllowedTokenIds`],
    /// [`BadWords`], [`MinTokens`], [`LogitBias`], [`RepetitionPenalty`],
    /// [`FrequencyPresencePenalty`], then either [`Selection::Greedy`] (temperature below
    /// 1e-5: steps 7-10 are skipped) or [`Temperature`], [`MinP`], [`TopK`], [`TopP`] and
    /// [`Selection::Sample`]. Steps whose parameter is off are left out (they would be no-ops).
    ///
    /// Its results equal [`crate::sample_row`] and [`crate::distribution`] with the same
    /// context (the prompt given to [`Self::reset`], the output ids to [`Self::accept`]), up to
    /// the rounding that spec/sampling.md ("Arithmetic") allows at boundaries.
    ///
    /// # Errors
    /// [`ParamError`] from [`crate::SamplingParams::validate`].
    pub fn from_params(params: &crate::SamplingParams) -> Result<Self, ParamError> {
        params.validate()?;
        let (n, logprobs, logprobs_kind) = (params.n, params.logprobs, params.logprobs_kind);
        let selection = if params.is_greedy() {
            Selection::Greedy {
                n,
                logprobs,
                logprobs_kind,
            }
        } else {
            Selection::Sample {
                seed: params.seed,
                n,
                logprobs,
                logprobs_kind,
            }
        };
        let mut chain = Self::new(selection);
        if let Some(ids) = &params.allowed_token_ids {
            chain.push(AllowedTokenIds::new(ids.clone())?);
        }
        if !params.bad_words.is_empty() {
            chain.push(BadWords::new(params.bad_words.clone())?);
        }
        if params.min_tokens > 0 {
            chain.push(MinTokens::new(params.min_tokens));
        }
        if !params.logit_bias.is_empty() {
            chain.push(LogitBias::new(params.logit_bias.clone())?);
        }
        if params.repetition_penalty != 1.0 {
            chain.push(RepetitionPenalty::new(params.repetition_penalty)?);
        }
        if params.frequency_penalty != 0.0 || params.presence_penalty != 0.0 {
            chain.push(FrequencyPresencePenalty::new(
                params.frequency_penalty,
                params.presence_penalty,
            )?);
        }
        if !params.is_greedy() {
            if params.temperature != 1.0 {
                chain.push(Temperature::new(params.temperature)?);
            }
            if params.min_p > 0.0 {
                chain.push(MinP::new(params.min_p)?);
            }
            if params.top_k > 0 {
                chain.push(TopK::new(params.top_k)?);
            }
            if params.top_p < 1.0 {
                chain.push(TopP::new(params.top_p)?);
            }
        }
        Ok(chain)
    }

    /// A chain from data: every entry but the last is a processor, the last is the selection
    /// (`sample` or `greedy`). See [`ProcessorConfig`] for the JSON form.
    ///
    /// # Errors
    /// - [`ChainError::NoSelection`]: the list is empty or its last entry is not a selection.
    /// - [`ChainError::SelectionNotLast`]: a selection step before the last entry.
    /// - [`ChainError::InvalidParams`]: an entry's parameter is out of range (the
    ///   [`ParamError`] names the field, as in [`crate::SamplingParams`]).
    pub fn from_config(config: &[ProcessorConfig]) -> Result<Self, ChainError> {
        let Some((last, rest)) = config.split_last() else {
            return Err(ChainError::NoSelection);
        };
        if let Some((index, entry)) = rest.iter().enumerate().find(|(_, c)| c.is_selection()) {
            return Err(ChainError::SelectionNotLast {
                index,
                name: entry.name(),
            });
        }
        let invalid = |index: usize, entry: &ProcessorConfig| {
            let name = entry.name();
            move |source: ParamError| ChainError::InvalidParams {
                index,
                name,
                source,
            }
        };
        let selection = last.to_selection().ok_or(ChainError::NoSelection)?;
        selection.validate().map_err(invalid(rest.len(), last))?;
        let mut chain = Self::new(selection);
        for (index, entry) in rest.iter().enumerate() {
            if let Some(p) = entry.to_processor().map_err(invalid(index, entry))? {
                chain.push_boxed(p);
            }
        }
        Ok(chain)
    }

    /// A new request starts: every processor clears its state and takes the prompt ids.
    pub fn reset(&mut self, prompt_ids: &[u32]) {
        for p in &mut self.processors {
            p.reset(prompt_ids);
        }
    }

    /// A token was committed to the sequence: every processor is told.
    pub fn accept(&mut self, token: u32) {
        for p in &mut self.processors {
            p.accept(token);
        }
    }

    /// Runs the checks and the processors on a copy of `logits`; returns the processed row
    /// (`vocab_size = logits.len()` f32 values, `-inf` for removed tokens) and its maximum.
    fn prepare(&mut self, logits: &[f32], ctx: &ProcessorContext<'_>) -> Result<f32, SampleError> {
        let vocab = logits.len();
        check_range("prompt_ids", ctx.prompt_ids, vocab)?;
        check_range("output_ids", ctx.output_ids, vocab)?;
        check_range("stop_token_ids", ctx.stop_token_ids, vocab)?;
        for p in &self.processors {
            p.check_ids(vocab)?;
        }
        if let Some(mask) = ctx.token_bitmask {
            let needed = crate::bitmask::bitmask_words(vocab);
            if mask.len() < needed {
                return Err(crate::BitmaskError::RowTooShort {
                    words: mask.len(),
                    needed,
                    row_len: vocab,
                }
                .into());
            }
        }
        check_finite(logits)?;
        self.logits.clear();
        self.logits.extend_from_slice(logits);
        if let Some(mask) = ctx.token_bitmask {
            crate::bitmask::mask_row(
                &mut self.logits,
                &mask[..crate::bitmask::bitmask_words(vocab)],
                f32::NEG_INFINITY,
            );
        }
        for p in &mut self.processors {
            p.apply(&mut self.logits, ctx)?;
        }
        check_finite(&self.logits)?;
        let max = row_max(&self.logits);
        if max == f32::NEG_INFINITY {
            return Err(SampleError::NoCandidates);
        }
        Ok(max)
    }

    /// Runs the processors (not the selection) on a copy of `logits` and returns the processed
    /// row: `logits.len()` f32 values, `-inf` for removed tokens. Borrowed from the chain's
    /// buffer until the next call.
    ///
    /// # Errors
    /// As [`Self::sample`], except the selection's.
    pub fn process(
        &mut self,
        logits: &[f32],
        ctx: &ProcessorContext<'_>,
    ) -> Result<&[f32], SampleError> {
        self.prepare(logits, ctx)?;
        Ok(&self.logits)
    }

    /// Samples one row.
    ///
    /// Arguments: `logits`, one row of `vocab_size = logits.len()` f32 logits (not modified);
    /// `ctx`, the step's context; `sample_index`, the first sample's index in the Philox
    /// counter (samples `sample_index .. sample_index + n`).
    ///
    /// Returns the token, its processed log-probability, the number of tokens with non-zero
    /// final probability, the seed, further samples for `n > 1` and the log-probabilities asked
    /// for, filled as [`crate::sample_row`] fills them (processed: logs of the final
    /// probabilities; raw: log-softmax of `logits` as given; the top list most likely first,
    /// ties to the lower id, padded with `-inf` entries of the lowest remaining ids).
    ///
    /// Randomness: `n` uniforms from Philox4x32-10 at `(seed, ctx.position, sample_index + j)`;
    /// greedy draws nothing.
    ///
    /// # Errors
    /// - [`SampleError::SeedUnavailable`]: no seed and the OS gave none.
    /// - [`SampleError::InvalidParams`]: `n` outside `1..=1024` or past `u32::MAX` with
    ///   `sample_index`; `logprobs > vocab_size`.
    /// - [`SampleError::TokenIdOutOfRange`]: a context id or a processor's id `>= vocab_size`.
    /// - [`SampleError::NonFiniteLogits`]: a NaN or `+inf` in `logits` (lowest such id), or
    ///   written by a processor.
    /// - [`SampleError::NoCandidates`]: every logit is `-inf` after the processors (or the row
    ///   is empty).
    /// - Any error of a processor (e.g. [`SampleError::PenaltyOverflow`]).
    pub fn sample(
        &mut self,
        logits: &[f32],
        ctx: &ProcessorContext<'_>,
        sample_index: u32,
    ) -> Result<SampleOutput, SampleError> {
        let selection = self.selection;
        let n = selection.n();
        let (top, kind) = selection.logprobs();
        let seed = match selection {
            Selection::Sample { seed: Some(s), .. } => s,
            Selection::Sample { seed: None, .. } => os_seed()?,
            Selection::Greedy { .. } => 0,
        };
        selection.validate()?;
        if sample_index.checked_add(n as u32 - 1).is_none() {
            return Err(ParamError::new(
                "n",
                n,
                "at most u32::MAX + 1 - sample_index (the sample indices must fit a u32)",
            )
            .into());
        }
        if let Some(top) = top {
            if top > logits.len() {
                return Err(ParamError::new("logprobs", top, "at most vocab_size").into());
            }
        }
        let max = self.prepare(logits, ctx)?;
        let mut output = match selection {
            Selection::Greedy { .. } => {
                let token = self.logits.iter().position(|&l| l == max).unwrap_or(0) as u32;
                SampleOutput {
                    token,
                    logprob: 0.0,
                    num_candidates: 1,
                    seed,
                    extra_samples: (1..n)
                        .map(|_| Sample {
                            token,
                            logprob: 0.0,
                        })
                        .collect(),
                    logprobs: None,
                }
            }
            Selection::Sample { .. } => {
                self.fill_weights(max);
                let w = &self.weights;
                let draw = |j: usize| {
                    let u = philox::uniform(seed, ctx.position, sample_index + j as u32);
                    select_dense(w, u)
                };
                let (token, weight, z, num_candidates) = draw(0);
                let extra_samples = (1..n)
                    .map(|j| {
                        let (token, weight, z, _) = draw(j);
                        Sample {
                            token,
                            logprob: (f64::from(weight) / z).ln(),
                        }
                    })
                    .collect();
                SampleOutput {
                    token,
                    logprob: (f64::from(weight) / z).ln(),
                    num_candidates,
                    seed,
                    extra_samples,
                    logprobs: None,
                }
            }
        };
        if let Some(top) = top {
            output.logprobs = Some(match kind {
                LogprobsKind::Processed => self.processed_logprobs(&output, top),
                LogprobsKind::Raw => raw_logprobs(logits, InputKind::Logits, &output, top),
            });
        }
        Ok(output)
    }

    /// The final probabilities the selection draws from: `logits.len()` f64 values, zero for
    /// removed tokens, summing to 1; one-hot on the argmax for greedy. Probability `i` is
    /// `w_i / Z` with `w_i = exp(l_i - max)` in f32 over the processed row and `Z` their f64
    /// sum in fixed id chunks, exactly what [`Self::sample`] uses.
    ///
    /// # Errors
    /// As [`Self::sample`], except that no seed is needed and `n` / `logprobs` are not checked.
    pub fn distribution(
        &mut self,
        logits: &[f32],
        ctx: &ProcessorContext<'_>,
    ) -> Result<Vec<f64>, SampleError> {
        let max = self.prepare(logits, ctx)?;
        let mut out = vec![0.0f64; logits.len()];
        if self.selection.is_greedy() {
            let token = self.logits.iter().position(|&l| l == max).unwrap_or(0);
            out[token] = 1.0;
        } else {
            self.fill_weights(max);
            let z = chunked_sum(self.weights.iter().copied().enumerate());
            for (o, &w) in out.iter_mut().zip(&self.weights) {
                *o = f64::from(w) / z;
            }
        }
        Ok(out)
    }

    /// `weights[i] = exp(logits[i] - max)` in f32 (0 for removed tokens).
    fn fill_weights(&mut self, max: f32) {
        self.weights.clear();
        self.weights
            .extend(self.logits.iter().map(|&l| (l - max).exp()));
    }

    fn processed_logprobs(&self, output: &SampleOutput, top: usize) -> Logprobs {
        let best = if self.selection.is_greedy() {
            vec![TokenLogprob {
                token_id: output.token,
                logprob: 0.0,
            }]
        } else {
            dense_top_logprobs(&self.weights, top)
        };
        processed_logprobs_from(output, best, top)
    }
}

impl LogitsProcessor for SamplerChain {
    fn name(&self) -> &str {
        "chain"
    }
    /// Runs the chain's processors in order (not its selection).
    fn apply(&mut self, logits: &mut [f32], ctx: &ProcessorContext<'_>) -> Result<(), SampleError> {
        for p in &mut self.processors {
            p.apply(logits, ctx)?;
        }
        Ok(())
    }
    fn reset(&mut self, prompt_ids: &[u32]) {
        SamplerChain::reset(self, prompt_ids);
    }
    fn accept(&mut self, token: u32) {
        SamplerChain::accept(self, token);
    }
    fn check_ids(&self, vocab_size: usize) -> Result<(), SampleError> {
        self.processors
            .iter()
            .try_for_each(|p| p.check_ids(vocab_size))
    }
    fn box_clone(&self) -> Box<dyn LogitsProcessor> {
        Box::new(self.clone())
    }
}

/// Step 1: the lowest id holding NaN or +inf is an error.
fn check_finite(row: &[f32]) -> Result<(), SampleError> {
    if kernels::max_bad(row).1 {
        Err(non_finite(row))
    } else {
        Ok(())
    }
}

// ---------------------------------------------------------------------------------------------
// Configuration as data
// ---------------------------------------------------------------------------------------------

/// Why a chain could not be built from a [`ProcessorConfig`] list.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
pub enum ChainError {
    /// The list is empty, or its last entry is not a selection step.
    #[error("a processor chain must end with a selection step (`sample` or `greedy`)")]
    NoSelection,
    /// A selection step appears before the last entry.
    #[error("selection step `{name}` at index {index} must be the last entry of the chain")]
    SelectionNotLast {
        /// Its index in the list.
        index: usize,
        /// `"sample"` or `"greedy"`.
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
/// | `{"repetition_penalty": {"penalty": 1.1}}` | [`RepetitionPenalty`] | `> 0` |
/// | `{"frequency_penalty": {"penalty": 0.5}}` | [`FrequencyPresencePenalty::frequency`] | `[-2, 2]` |
/// | `{"presence_penalty": {"penalty": 0.5}}` | [`FrequencyPresencePenalty::presence`] | `[-2, 2]` |
/// | `{"temperature": {"t": 0.8}}` | [`Temperature`] | `>= 1e-5` |
/// | `{"min_p": {"p": 0.05}}` | [`MinP`] | `[0, 1]` |
/// | `{"top_k": {"k": 50}}` | [`TopK`] | `>= -1` |
/// | `{"top_p": {"p": 0.9}}` | [`TopP`] | `(0, 1]` |
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
    },
    /// [`TopK`].
    TopK {
        /// `>= -1`; 0 and -1 are off.
        k: i64,
    },
    /// [`TopP`].
    TopP {
        /// In `(0, 1]`.
        #[serde(with = "lenient_f64")]
        p: f64,
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
            ProcessorConfig::Greedy { .. } => "greedy",
            ProcessorConfig::Sample { .. } => "sample",
        }
    }

    /// Whether this is a selection step (`sample` or `greedy`).
    pub fn is_selection(&self) -> bool {
        matches!(
            self,
            ProcessorConfig::Greedy { .. } | ProcessorConfig::Sample { .. }
        )
    }

    /// The selection step, for `sample` and `greedy` entries (not validated; see
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
            ProcessorConfig::RepetitionPenalty { penalty } => {
                Box::new(RepetitionPenalty::new(*penalty)?)
            }
            ProcessorConfig::FrequencyPenalty { penalty } => {
                Box::new(FrequencyPresencePenalty::frequency(*penalty)?)
            }
            ProcessorConfig::PresencePenalty { penalty } => {
                Box::new(FrequencyPresencePenalty::presence(*penalty)?)
            }
            ProcessorConfig::Temperature { t } => Box::new(Temperature::new(*t)?),
            ProcessorConfig::MinP { p } => Box::new(MinP::new(*p)?),
            ProcessorConfig::TopK { k } => Box::new(TopK::new(*k)?),
            ProcessorConfig::TopP { p } => Box::new(TopP::new(*p)?),
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
