//! Processor chains: each step of the fixed `SamplingParams` path as a processor of its own,
//! composed in any order and ended by a selection step, like llama.cpp's sampler chain
//! (`llama_sampler_chain_init` / `llama_sampler_chain_add`, `llama_sampler_i`'s apply / accept
//! / reset / clone).
//!
//! A [`SamplerChain`] is an ordered list of [`LogitsProcessor`]s followed by one
//! [`Selection`] (sample, greedy, or llama.cpp's mirostat v1 / v2 and adaptive-p, whose
//! per-request state the chain carries). For one row of logits it
//! 1. checks the context ids and every processor's token ids against the vocabulary
//!    ([`SampleError::TokenIdOutOfRange`]) and the row itself (a NaN or +inf logit is
//!    [`SampleError::NonFiniteLogits`], spec/sampling.md step 1),
//! 2. copies the row into its own buffer (the caller's logits are never written) and runs the
//!    processors on it in order; a processor removes a token by writing `-inf`,
//! 3. fails with [`SampleError::NoCandidates`] when every logit is `-inf` (step 12),
//! 4. selects: greedy takes the argmax (ties to the lowest id); sample forms the weights
//!    `exp(l - max)` in f32 and draws by inverse CDF in token-id order (step 11) with uniforms
//!    from the request's Philox stream; mirostat truncates those weights first, adaptive-p
//!    transforms the row first ([`Mirostat::weights`], [`AdaptiveP::transform`]).
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

use std::fmt;

use crate::error::{ParamError, SampleError};
use crate::kernels;
use crate::params::LogprobsKind;
use crate::params::MAX_N;
use crate::philox;
use crate::sampler::{
    dense_top_logprobs, non_finite, os_seed, processed_logprobs_from, raw_logprobs, select_dense,
    Cand, Logprobs, Sample, SampleOutput, TokenLogprob,
};
use crate::view::InputKind;

mod config;
mod constraints;
mod filters;
pub(crate) mod passes;
mod penalties;
mod repetition;
mod stochastic;
mod temperature;

pub use config::{lenient_f64, lenient_f64_map, ChainError, LenientF64, ProcessorConfig};
pub use constraints::{
    AllowedTokenIds, BadWords, ForcedBos, ForcedEos, InfNanRemove, MinTokens, SuppressTokens,
    SuppressTokensAtBegin,
};
pub use filters::{Epsilon, MinP, TopK, TopNSigma, TopP};
pub use penalties::{
    EncoderRepetitionPenalty, ExponentialDecayLengthPenalty, FrequencyPresencePenalty, LogitBias,
    RepetitionPenalty, SequenceBias,
};
pub use repetition::{
    resolve_sequence_breakers, Dry, EncoderNoRepeatNGram, NoRepeatNGram,
    DRY_DEFAULT_ALLOWED_LENGTH, DRY_DEFAULT_BASE, DRY_DEFAULT_PENALTY_LAST_N,
    DRY_DEFAULT_SEQUENCE_BREAKERS, DRY_MAX_BREAKERS, DRY_MAX_BREAKER_BYTES, DRY_MAX_BREAKER_TAIL,
};
pub use stochastic::{
    adaptive_p_update, mirostat_distribution, mirostat_update, AdaptiveP, AdaptivePState, Mirostat,
    MirostatVersion, Xtc, ADAPTIVE_P_PEAK, ADAPTIVE_P_SHARPNESS, ADAPTIVE_P_WIDTH,
};
/// Mirostat v1's `m` on the `SamplingParams` path: llama.cpp's server fixes it at 100
/// (`common_sampler_init`: `llama_sampler_init_mirostat(n_vocab, seed, tau, eta, 100)`).
pub const MIROSTAT_M: usize = 100;

pub use temperature::{DynamicTemperature, Eta, LogSoftmax, Temperature, TopH, Typical};

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
    /// The request's stream seed, for processors that draw (XTC's coin). The chain sets it
    /// from its [`Selection`] (or the seed drawn from the OS) before its processors run; 0 when
    /// a processor is applied on its own.
    pub seed: u64,
    /// The first sample index of this call (the Philox counter's third word). Set by the chain
    /// ([`SamplerChain::sample`]'s `sample_index`).
    pub sample_index: u32,
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
            seed: 0,
            sample_index: 0,
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

    /// Whether this processor takes rows holding NaN or `+inf` (Hugging Face's
    /// `InfNanRemoveLogitsProcessor` does). The processors at the start of a chain that say so
    /// run on the row as given, before the token bitmask and the row check of spec step 1;
    /// every other processor sees a row free of NaN and `+inf`. Default `false`.
    fn accepts_non_finite(&self) -> bool {
        false
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
pub(crate) fn check_range<'a>(
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

pub(crate) fn row_max(values: &[f32]) -> f32 {
    kernels::max_bad(values).0
}

/// The filtering order: larger logit first, then lower id (spec steps 9-10). Logits are
/// stored with `-0.0` turned into `0.0`, so `total_cmp` agrees with `==` on them.
#[inline]
pub(crate) fn better(a: &(f32, u32), b: &(f32, u32)) -> std::cmp::Ordering {
    b.0.total_cmp(&a.0).then(a.1.cmp(&b.1))
}

// ---------------------------------------------------------------------------------------------
// Selection and the chain
// ---------------------------------------------------------------------------------------------

/// The last step of a chain: how the token is chosen from the processed logits.
///
/// [`Selection::Sample`] and [`Selection::Greedy`] are stateless. The llama.cpp selections
/// [`Selection::Mirostat`], [`Selection::MirostatV2`] and [`Selection::AdaptiveP`] carry state
/// per request (`mu`, the adaptive-p moving average) that lives in the [`SamplerChain`]: it
/// starts at its initial value, moves on [`SamplerChain::accept`], returns to its start on
/// [`SamplerChain::reset`] and is copied by a clone. All drawing selections draw by inverse CDF
/// in token-id order (spec step 11) from their final weights, with `n` uniforms from
/// Philox4x32-10 at `(seed, ctx.position, sample_index + j)`, `j in 0..n`
/// ([`philox::uniform`], draw kind [`philox::draw::SELECT`]).
#[derive(Clone, Copy, Debug, PartialEq)]
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
    /// Mirostat 1.0 (llama.cpp `llama_sampler_mirostat_apply`; see [`Mirostat::weights`]):
    /// top-k with `k` from the Zipf estimate over the `m` most probable tokens and the state
    /// `mu`, then sampling from the renormalised top-k. `mu` starts at `2 tau`; accepting a
    /// token of probability `p` under that truncated distribution sets
    /// `mu -= eta (-log2 p - tau)` ([`mirostat_update`]). `n_vocab` is the row's length.
    /// A cloned chain copies `mu` (llama.cpp's `llama_sampler_mirostat_clone` writes the state
    /// back into the source, so its clone restarts at `2 tau`: a bug, fixed here; v2's clone
    /// copies it).
    Mirostat {
        /// Target surprise in bits (default 5), finite, `>= 0`.
        tau: f64,
        /// Learning rate (default 0.1), finite, `>= 0`.
        eta: f64,
        /// Tokens in the estimate (default 100), `>= 2`.
        m: usize,
        /// The stream's seed, as [`Selection::Sample`]'s.
        seed: Option<u64>,
        /// Samples per row from the one truncated distribution, `1..=`[`MAX_N`].
        n: usize,
        /// Top log-probabilities to report (processed: of the truncated distribution).
        logprobs: Option<usize>,
        /// Which distribution the log-probabilities come from.
        logprobs_kind: LogprobsKind,
    },
    /// Mirostat 2.0 (llama.cpp `llama_sampler_mirostat_v2_apply`; see [`Mirostat::weights`]):
    /// keeps the tokens of surprise `-log2 p <= mu` (at least the most probable), then samples
    /// from them renormalised; `mu` as in [`Selection::Mirostat`].
    MirostatV2 {
        /// Target surprise in bits (default 5), finite, `>= 0`.
        tau: f64,
        /// Learning rate (default 0.1), finite, `>= 0`.
        eta: f64,
        /// The stream's seed, as [`Selection::Sample`]'s.
        seed: Option<u64>,
        /// Samples per row from the one truncated distribution, `1..=`[`MAX_N`].
        n: usize,
        /// Top log-probabilities to report (processed: of the truncated distribution).
        logprobs: Option<usize>,
        /// Which distribution the log-probabilities come from.
        logprobs_kind: LogprobsKind,
    },
    /// Adaptive-p (llama.cpp `llama_sampler_init_adaptive_p`; see [`AdaptiveP`]): samples from
    /// a transform of the probabilities that favours tokens near an adapted target; accepting a
    /// token moves the moving average of original probabilities. A negative `target` is plain
    /// sampling.
    AdaptiveP {
        /// Target probability, finite, `<= 1`; negative disables the transform.
        target: f64,
        /// Moving-average decay (default 0.9), `[0, 0.99]`.
        decay: f64,
        /// The stream's seed, as [`Selection::Sample`]'s.
        seed: Option<u64>,
        /// Samples per row from the one transformed distribution, `1..=`[`MAX_N`].
        n: usize,
        /// Top log-probabilities to report (processed: of the transformed distribution).
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

    /// Mirostat 1.0, one sample per row, no logprobs.
    pub fn mirostat(tau: f64, eta: f64, m: usize, seed: Option<u64>) -> Self {
        Selection::Mirostat {
            tau,
            eta,
            m,
            seed,
            n: 1,
            logprobs: None,
            logprobs_kind: LogprobsKind::Processed,
        }
    }

    /// Mirostat 2.0, one sample per row, no logprobs.
    pub fn mirostat_v2(tau: f64, eta: f64, seed: Option<u64>) -> Self {
        Selection::MirostatV2 {
            tau,
            eta,
            seed,
            n: 1,
            logprobs: None,
            logprobs_kind: LogprobsKind::Processed,
        }
    }

    /// Adaptive-p, one sample per row, no logprobs.
    pub fn adaptive_p(target: f64, decay: f64, seed: Option<u64>) -> Self {
        Selection::AdaptiveP {
            target,
            decay,
            seed,
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
            Selection::Sample { n, .. }
            | Selection::Greedy { n, .. }
            | Selection::Mirostat { n, .. }
            | Selection::MirostatV2 { n, .. }
            | Selection::AdaptiveP { n, .. } => n,
        }
    }

    /// The stream's seed of a drawing selection (`Some(None)`: from the OS); `None` for greedy.
    pub(crate) fn draw_seed(&self) -> Option<Option<u64>> {
        match *self {
            Selection::Greedy { .. } => None,
            Selection::Sample { seed, .. }
            | Selection::Mirostat { seed, .. }
            | Selection::MirostatV2 { seed, .. }
            | Selection::AdaptiveP { seed, .. } => Some(seed),
        }
    }

    pub(crate) fn logprobs(&self) -> (Option<usize>, LogprobsKind) {
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
            }
            | Selection::Mirostat {
                logprobs,
                logprobs_kind,
                ..
            }
            | Selection::MirostatV2 {
                logprobs,
                logprobs_kind,
                ..
            }
            | Selection::AdaptiveP {
                logprobs,
                logprobs_kind,
                ..
            } => (logprobs, logprobs_kind),
        }
    }

    /// The mirostat parameters of [`Selection::Mirostat`] / [`Selection::MirostatV2`].
    ///
    /// # Errors
    /// As [`Mirostat::v1`] / [`Mirostat::v2`].
    pub fn to_mirostat(&self) -> Option<Result<Mirostat, ParamError>> {
        match *self {
            Selection::Mirostat { tau, eta, m, .. } => Some(Mirostat::v1(tau, eta, m)),
            Selection::MirostatV2 { tau, eta, .. } => Some(Mirostat::v2(tau, eta)),
            _ => None,
        }
    }

    /// The adaptive-p parameters of [`Selection::AdaptiveP`].
    ///
    /// # Errors
    /// As [`AdaptiveP::new`].
    pub fn to_adaptive_p(&self) -> Option<Result<AdaptiveP, ParamError>> {
        match *self {
            Selection::AdaptiveP { target, decay, .. } => Some(AdaptiveP::new(target, decay)),
            _ => None,
        }
    }

    /// Checks `n` and the mirostat / adaptive-p parameters.
    ///
    /// # Errors
    /// [`ParamError`] for `n` outside `1..=1024`, or as [`Mirostat::v1`], [`Mirostat::v2`],
    /// [`AdaptiveP::new`].
    pub fn validate(&self) -> Result<(), ParamError> {
        let n = self.n();
        if !(1..=MAX_N).contains(&n) {
            return Err(ParamError::new("n", n, "1..=1024"));
        }
        if let Some(m) = self.to_mirostat() {
            m?;
        }
        if let Some(a) = self.to_adaptive_p() {
            a?;
        }
        Ok(())
    }
}

/// A stateful selection's state in a [`SamplerChain`].
#[derive(Clone, Copy, Debug, PartialEq)]
struct SelectionState {
    /// Mirostat's `mu` (0 for the other selections).
    mu: f64,
    /// Adaptive-p's moving average.
    adaptive: AdaptivePState,
    /// `Z` of the distribution of the last successful [`SamplerChain::sample`] or
    /// [`SamplerChain::distribution`] of a stateful selection since the last accept or reset:
    /// the truncated weights' sum (mirostat) or the original weights' (adaptive-p).
    pending: Option<f64>,
}

impl SelectionState {
    fn initial(selection: &Selection) -> Self {
        let mu = match *selection {
            Selection::Mirostat { tau, .. } | Selection::MirostatV2 { tau, .. } => 2.0 * tau,
            _ => 0.0,
        };
        let adaptive = match *selection {
            Selection::AdaptiveP { target, decay, .. } => {
                stochastic::adaptive_p_initial_state(target, decay)
            }
            _ => stochastic::adaptive_p_initial_state(0.0, 0.0),
        };
        Self {
            mu,
            adaptive,
            pending: None,
        }
    }
}

/// An ordered list of [`LogitsProcessor`]s ending in a [`Selection`] (llama.cpp's sampler
/// chain; STYLE.md point 3). Cloning clones every processor with its state, the selection's
/// state (mirostat's `mu`, adaptive-p's average, the pending distribution) and the buffers: a
/// clone continues independently.
///
/// The chain owns buffers of `vocab_size` f32 values (the processed row, the weights, and for
/// adaptive-p the original weights), reused across calls: once warm, [`Self::sample`]
/// allocates only for `n > 1` or logprobs.
///
/// Stateful selections ([`Selection::Mirostat`], [`Selection::MirostatV2`],
/// [`Selection::AdaptiveP`]): unlike llama.cpp, which updates its state inside apply, the state
/// moves in [`Self::accept`], from the distribution of the last successful [`Self::sample`] or
/// [`Self::distribution`] call (the pending distribution). [`Self::accept`] consumes it: a
/// second accept without a new distribution in between (a prompt or forced token), an accept
/// with no distribution computed since the last reset, and an accepted token outside the
/// pending distribution (probability 0 there, or an id beyond the row) leave the state
/// unchanged.
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
    /// Adaptive-p's original weights of the last row.
    original: Vec<f32>,
    /// Mirostat v1's best candidates.
    top: Vec<Cand>,
    state: SelectionState,
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
            original: Vec::new(),
            top: Vec::new(),
            state: SelectionState::initial(&selection),
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

    /// Replaces the selection step; its state starts afresh (as after [`Self::reset`]).
    pub fn set_selection(&mut self, selection: Selection) {
        self.selection = selection;
        self.state = SelectionState::initial(&selection);
    }

    /// Mirostat's current `mu` ([`Selection::Mirostat`], [`Selection::MirostatV2`]); `None`
    /// for the other selections.
    pub fn mirostat_mu(&self) -> Option<f64> {
        self.selection.to_mirostat().map(|_| self.state.mu)
    }

    /// Adaptive-p's current moving average ([`Selection::AdaptiveP`]); `None` for the other
    /// selections.
    pub fn adaptive_p_state(&self) -> Option<AdaptivePState> {
        self.selection.to_adaptive_p().map(|_| self.state.adaptive)
    }

    /// Sets mirostat's `mu` (for a stateless caller that carries it per request, as the
    /// `SamplingParams` path does with [`crate::SampleRequest::mirostat_mu`]); no pending
    /// distribution. Does nothing for the other selections.
    pub fn set_mirostat_mu(&mut self, mu: f64) {
        if self.selection.to_mirostat().is_some() {
            self.state.mu = mu;
            self.state.pending = None;
        }
    }

    /// The fixed chain of spec/sampling.md steps 3-11 and its "Extended processors in the fixed
    /// path" for `params`:
    /// 3. [`AllowedTokenIds`], [`BadWords`], [`MinTokens`];
    /// 4. [`LogitBias`], 4a [`SequenceBias`];
    /// 5. [`RepetitionPenalty`], [`FrequencyPresencePenalty`], 5a [`Dry`], 5b [`NoRepeatNGram`];
    /// 6. temperature below 1e-5: [`Selection::Greedy`], steps 7-11 skipped (mirostat included);
    /// 7. [`DynamicTemperature`] when `dynatemp_range > 0`, else [`Temperature`]
    ///    ([`Temperature::after_max_subtraction`]);
    /// 8. - 10e. with `mirostat` 0: [`MinP`], [`TopK`], [`TopP`], [`Typical`], [`TopNSigma`],
    ///    [`Epsilon`], [`Eta`], [`Xtc`], every filter with `min_keep`, then
    ///    [`Selection::Sample`]; with `mirostat` 1 or 2 none of them, and
    ///    [`Selection::Mirostat`] (m = 100, as llama.cpp's server) or [`Selection::MirostatV2`].
    ///
    /// Steps whose parameter is off are left out (they would be no-ops).
    ///
    /// Its results equal [`crate::sample_row`] and [`crate::distribution`] with the same
    /// context (the prompt given to [`Self::reset`], the output ids to [`Self::accept`]), up to
    /// the rounding that spec/sampling.md ("Arithmetic") allows at boundaries; requests with
    /// extended fields run on this chain inside [`crate::sample_row`].
    ///
    /// # Errors
    /// [`ParamError`] from [`crate::SamplingParams::validate`].
    pub fn from_params(params: &crate::SamplingParams) -> Result<Self, ParamError> {
        params.validate()?;
        let (n, logprobs, logprobs_kind) = (params.n, params.logprobs, params.logprobs_kind);
        let seed = params.seed;
        let selection = if params.is_greedy() {
            Selection::Greedy {
                n,
                logprobs,
                logprobs_kind,
            }
        } else {
            match params.mirostat {
                1 => Selection::Mirostat {
                    tau: params.mirostat_tau,
                    eta: params.mirostat_eta,
                    m: MIROSTAT_M,
                    seed,
                    n,
                    logprobs,
                    logprobs_kind,
                },
                2 => Selection::MirostatV2 {
                    tau: params.mirostat_tau,
                    eta: params.mirostat_eta,
                    seed,
                    n,
                    logprobs,
                    logprobs_kind,
                },
                _ => Selection::Sample {
                    seed,
                    n,
                    logprobs,
                    logprobs_kind,
                },
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
        if !params.sequence_bias.is_empty() {
            chain.push(SequenceBias::new(params.sequence_bias.clone())?);
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
        if params.dry_enabled() {
            chain.push(Dry::new(
                params.dry_multiplier,
                params.dry_base,
                i64::try_from(params.dry_allowed_length).unwrap_or(i64::MAX),
                params.dry_penalty_last_n,
                params.dry_sequence_breakers.clone(),
            )?);
        }
        if params.no_repeat_ngram_size > 0 {
            chain.push(NoRepeatNGram::new(
                i64::try_from(params.no_repeat_ngram_size).unwrap_or(i64::MAX),
            )?);
        }
        if params.is_greedy() {
            return Ok(chain);
        }
        if params.dynatemp_range > 0.0 {
            chain.push(DynamicTemperature::new(
                params.temperature,
                params.dynatemp_range,
                params.dynatemp_exponent,
            )?);
        } else if params.temperature != 1.0 {
            chain.push(Temperature::after_max_subtraction(params.temperature)?);
        }
        if params.mirostat != 0 {
            return Ok(chain);
        }
        let keep = params.min_keep;
        if params.min_p > 0.0 {
            chain.push(MinP::new(params.min_p)?.with_min_keep(keep)?);
        }
        if params.top_k > 0 {
            chain.push(TopK::new(params.top_k)?.with_min_keep(keep)?);
        }
        if params.top_p < 1.0 {
            chain.push(TopP::new(params.top_p)?.with_min_keep(keep)?);
        }
        if params.typical_p < 1.0 {
            chain.push(Typical::new(params.typical_p)?.with_min_keep(keep)?);
        }
        if params.top_n_sigma > 0.0 {
            chain.push(TopNSigma::new(params.top_n_sigma)?);
        }
        if params.epsilon_cutoff > 0.0 {
            chain.push(Epsilon::new(params.epsilon_cutoff)?.with_min_keep(keep)?);
        }
        if params.eta_cutoff > 0.0 {
            chain.push(Eta::new(params.eta_cutoff)?.with_min_keep(keep)?);
        }
        if params.xtc_probability > 0.0 && params.xtc_threshold <= 0.5 {
            chain.push(Xtc::new(
                params.xtc_threshold,
                params.xtc_probability,
                keep,
            )?);
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

    /// A new request starts: every processor clears its state and takes the prompt ids; the
    /// selection's state returns to its start (mirostat `mu = 2 tau`, adaptive-p's average on
    /// target) with no pending distribution.
    pub fn reset(&mut self, prompt_ids: &[u32]) {
        for p in &mut self.processors {
            p.reset(prompt_ids);
        }
        self.state = SelectionState::initial(&self.selection);
    }

    /// A token was committed to the sequence: every processor is told, and a stateful
    /// selection updates from the pending distribution (see the type's doc): mirostat
    /// `mu -= eta (-log2 p(token) - tau)` with `p` the token's probability under the truncated,
    /// renormalised distribution ([`mirostat_update`]); adaptive-p its average with the token's
    /// original probability ([`AdaptiveP::update`]).
    ///
    /// llama.cpp's adaptive-p updates only when the accepted token is the one its apply
    /// selected; here any token of the pending distribution updates (the same for a loop that
    /// accepts what it sampled).
    pub fn accept(&mut self, token: u32) {
        for p in &mut self.processors {
            p.accept(token);
        }
        let Some(z) = self.state.pending.take() else {
            return;
        };
        let i = token as usize;
        let w = self.weights.get(i).copied().unwrap_or(0.0);
        if w <= 0.0 {
            return;
        }
        match self.selection {
            Selection::Mirostat { tau, eta, .. } | Selection::MirostatV2 { tau, eta, .. } => {
                self.state.mu = mirostat_update(self.state.mu, f64::from(w) / z, tau, eta);
            }
            Selection::AdaptiveP { decay, .. } => {
                let p = f64::from(self.original[i]) / z;
                self.state.adaptive = adaptive_p_update(self.state.adaptive, p, decay);
            }
            Selection::Sample { .. } | Selection::Greedy { .. } => {}
        }
    }

    /// The context the processors see: `ctx` with the selection's seed when it has one.
    fn seeded<'c>(&self, ctx: &ProcessorContext<'c>) -> ProcessorContext<'c> {
        let mut ctx = *ctx;
        if let Some(Some(s)) = self.selection.draw_seed() {
            ctx.seed = s;
        }
        ctx
    }

    /// Runs the checks and the processors on a copy of `logits`; returns the processed row
    /// (`vocab_size = logits.len()` f32 values, `-inf` for removed tokens) and its maximum.
    /// Processors see `ctx` as given (its `seed` and `sample_index` already set by the caller).
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
        // Processors that take non-finite rows (inf/nan removal) run first when they lead.
        let lead = self
            .processors
            .iter()
            .take_while(|p| p.accepts_non_finite())
            .count();
        if lead == 0 {
            check_finite(logits)?;
        }
        self.logits.clear();
        self.logits.extend_from_slice(logits);
        for p in &mut self.processors[..lead] {
            p.apply(&mut self.logits, ctx)?;
        }
        if lead > 0 {
            check_finite(&self.logits)?;
        }
        if let Some(mask) = ctx.token_bitmask {
            crate::bitmask::mask_row(
                &mut self.logits,
                &mask[..crate::bitmask::bitmask_words(vocab)],
                f32::NEG_INFINITY,
            );
        }
        for p in &mut self.processors[lead..] {
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
    /// Processors that draw (XTC) use the selection's seed when it has one, else `ctx.seed`,
    /// and `ctx.sample_index`.
    ///
    /// # Errors
    /// As [`Self::sample`], except the selection's.
    pub fn process(
        &mut self,
        logits: &[f32],
        ctx: &ProcessorContext<'_>,
    ) -> Result<&[f32], SampleError> {
        let ctx = self.seeded(ctx);
        self.prepare(logits, &ctx)?;
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
    /// greedy draws nothing. The drawing selections other than [`Selection::Sample`] draw from
    /// their truncated (mirostat) or transformed (adaptive-p) weights, and leave that
    /// distribution pending for [`Self::accept`].
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
        self.state.pending = None;
        let seed = match selection.draw_seed() {
            Some(Some(s)) => s,
            Some(None) => os_seed()?,
            None => 0,
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
        let mut ctx = *ctx;
        ctx.seed = seed;
        ctx.sample_index = sample_index;
        let ctx = &ctx;
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
                    mirostat_mu: None,
                }
            }
            _ => {
                self.fill_selection_weights(max)?;
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
                    mirostat_mu: None,
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
    /// sum in fixed id chunks, exactly what [`Self::sample`] uses: for mirostat the truncated
    /// weights of the current `mu` ([`Mirostat::weights`]), for adaptive-p the weights of the
    /// transformed row ([`AdaptiveP::transform`]). Like [`Self::sample`], it leaves that
    /// distribution pending for [`Self::accept`].
    ///
    /// Processors that draw (XTC's coin) use the selection's seed when it has one, else
    /// `ctx.seed`, and `ctx.sample_index`: the distribution [`Self::sample`] draws from with
    /// that seed and `sample_index`.
    ///
    /// # Errors
    /// As [`Self::sample`], except that no seed is needed and `n` / `logprobs` are not checked.
    pub fn distribution(
        &mut self,
        logits: &[f32],
        ctx: &ProcessorContext<'_>,
    ) -> Result<Vec<f64>, SampleError> {
        self.state.pending = None;
        let ctx = self.seeded(ctx);
        let max = self.prepare(logits, &ctx)?;
        let mut out = vec![0.0f64; logits.len()];
        if self.selection.is_greedy() {
            let token = self.logits.iter().position(|&l| l == max).unwrap_or(0);
            out[token] = 1.0;
        } else {
            self.fill_selection_weights(max)?;
            let z = passes::sum_weights(&self.weights);
            for (o, &w) in out.iter_mut().zip(&self.weights) {
                *o = f64::from(w) / z;
            }
        }
        Ok(out)
    }

    /// The weights a drawing selection draws from, from the processed row of maximum `max`;
    /// a stateful selection's distribution becomes pending.
    fn fill_selection_weights(&mut self, max: f32) -> Result<(), SampleError> {
        if let Some(mirostat) = self.selection.to_mirostat() {
            let z = mirostat?.weights_with(
                &self.logits,
                self.state.mu,
                &mut self.weights,
                &mut self.top,
            )?;
            self.state.pending = Some(z);
            return Ok(());
        }
        if let Some(adaptive) = self.selection.to_adaptive_p() {
            let adaptive = adaptive?;
            if !adaptive.is_off() {
                let z = adaptive.transform(
                    &mut self.logits,
                    &self.state.adaptive,
                    &mut self.original,
                )?;
                let max = row_max(&self.logits);
                self.fill_weights(max);
                self.state.pending = Some(z);
                return Ok(());
            }
        }
        self.fill_weights(max);
        Ok(())
    }

    /// `weights[i] = exp(logits[i] - max)` in f32 (0 for removed tokens).
    fn fill_weights(&mut self, max: f32) {
        passes::exp_weights(&self.logits, max, &mut self.weights);
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
