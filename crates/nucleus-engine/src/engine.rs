//! [`Engine`]: requests in, tokens and text out, one decode step at a time.
//!
//! The loop of MiniMind's `generate` (seed 003) and of vLLM's scheduler, cut to its core:
//! requests join with [`Engine::add_request`]; each [`Engine::step`] runs one forward pass over
//! every live sequence (a whole prompt for a new one, prefill; the last sampled token for the
//! others, decode), samples all their rows with one `nucleus_sampling::sample_batch` call,
//! and applies the stop conditions. A finished sequence leaves the batch at once and costs no
//! more work; requests may join or leave between any two steps.
//!
//! A request with `n > 1` samples is prefilled once; its KV cache is then copied into `n`
//! sequences that draw their first token from the same logits with sample indices `0..n`
//! (the third word of the Philox counter) and continue independently.
//!
//! Structured output (seed 001 §05-07): a request may carry a grammar ([`Request::grammar`]),
//! compiled once per engine and grammar by nucleus-grammar (llguidance) and matched per
//! sample. Each step, while the forward pass runs, worker threads fill every grammar sample's
//! token bitmask for the token that pass's logits will choose (rayon, in parallel across
//! samples); the sampler masks the row at spec step 3, so EOS is possible only where the
//! grammar may end. The sampled token is validated before it is committed; a sample whose
//! grammar can take nothing more finishes with [`FinishReason::Stop`].

use std::sync::Arc;
use std::time::{Duration, Instant};

use nucleus_grammar::{GrammarCompiler, GrammarMatcher, GrammarOptions, GrammarSpec, TokenEnv};
use nucleus_sampling::chain::{ProcessorContext, SamplerChain, Selection};
use nucleus_sampling::{
    bitmask_words, os_seed, sample_batch, LogitsView, SampleRequest, SamplingParams,
};

use crate::detokenize::{ByteTokens, IncrementalDecoder, StopStrings};
use crate::error::{EngineError, Result};
use crate::kv_cache::{KvCache, KvCacheDtype};
use crate::models::{CausalLm, SeqInput};
use crate::tokenizer::ModelTokenizer;

/// The most samples one request may ask for: each sample keeps its own KV cache.
pub const MAX_SAMPLES_PER_REQUEST: usize = 1024;

/// The prompt of a request.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Prompt {
    /// Text, tokenised with the model's tokenizer (BOS added as the tokenizer prescribes).
    Text(String),
    /// Token ids, used as given.
    Tokens(Vec<u32>),
}

/// One generation request.
#[derive(Clone, Debug)]
pub struct Request {
    /// The prompt.
    pub prompt: Prompt,
    /// Sampling parameters. A `seed` of `None` is drawn from the OS once, when the request is
    /// added, and reported in [`RequestInfo`].
    pub params: SamplingParams,
    /// Most tokens to generate per sample (>= 1).
    pub max_tokens: usize,
    /// Token ids that end a sample with [`FinishReason::Stop`] (not included in the text).
    pub stop_token_ids: Vec<u32>,
    /// Strings that end a sample with [`FinishReason::Stop`]; the text stops before the first
    /// one (not included), as in vLLM and the OpenAI API.
    pub stop_strings: Vec<String>,
    /// Samples to draw for this prompt, 1 to [`MAX_SAMPLES_PER_REQUEST`]: sample `j` uses
    /// sample index `j`.
    pub n: usize,
    /// Do not stop at the tokenizer's EOS. Not with a grammar (EOS is where a grammar ends).
    pub ignore_eos: bool,
    /// Structured output: every sample's text must match this grammar (a JSON Schema, a
    /// regular expression or a Lark grammar; see nucleus-grammar). EOS is allowed only where the
    /// grammar may end; a sample whose grammar can take nothing more finishes with
    /// [`FinishReason::Stop`]; one that reaches `max_tokens` first finishes with
    /// [`FinishReason::Length`] and its incomplete text, as in vLLM. `None`: unconstrained.
    pub grammar: Option<GrammarSpec>,
    /// Options of [`Self::grammar`]: JSON whitespace is bounded to 8 characters in a row by
    /// default.
    pub grammar_options: GrammarOptions,
    /// End the text with the stop string that stopped it (vLLM's
    /// `include_stop_str_in_output`; default false: the text stops before it).
    pub include_stop_str_in_output: bool,
    /// Leave special (control) tokens out of the text (vLLM's `skip_special_tokens`; default
    /// true).
    pub skip_special_tokens: bool,
    /// Sample with this processor chain instead of [`Self::params`]' fixed order (llama.cpp's
    /// custom sampler order). `params` still gives the seed (a selection without one takes
    /// the request's), `min_tokens` is the chain's to apply, and the grammar's bitmask and the
    /// stop ids reach the chain through its context. The chain's selection must draw one
    /// sample (`n == 1`; [`Self::n`] forks the samples). Each sample gets its own clone, reset
    /// with the prompt and told every committed token. Not with [`Engine::rollback`].
    pub chain: Option<SamplerChain>,
}

impl Request {
    /// A text request with default sampling, 256 tokens, one sample.
    pub fn new(prompt: impl Into<String>) -> Self {
        Self {
            prompt: Prompt::Text(prompt.into()),
            params: SamplingParams::default(),
            max_tokens: 256,
            stop_token_ids: Vec::new(),
            stop_strings: Vec::new(),
            n: 1,
            ignore_eos: false,
            grammar: None,
            grammar_options: GrammarOptions::default(),
            include_stop_str_in_output: false,
            skip_special_tokens: true,
            chain: None,
        }
    }
}

/// Why a sample finished.
#[derive(Clone, Debug, PartialEq)]
pub enum FinishReason {
    /// The model produced its end-of-sequence token.
    Eos,
    /// A stop token id or a stop string, or the request's grammar can take no more text.
    Stop,
    /// `max_tokens` reached, or the model's context is full.
    Length,
    /// This sample failed (e.g. non-finite logits); the rest of the batch went on.
    Error(String),
}

impl std::fmt::Display for FinishReason {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            FinishReason::Eos => write!(f, "eos"),
            FinishReason::Stop => write!(f, "stop"),
            FinishReason::Length => write!(f, "length"),
            FinishReason::Error(e) => write!(f, "error: {e}"),
        }
    }
}

/// What [`Engine::add_request`] returns.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RequestInfo {
    /// The request's id (ascending from 0 per engine).
    pub request_id: u64,
    /// The prompt as token ids.
    pub prompt_ids: Vec<u32>,
    /// The seed in use (given, or drawn from the OS).
    pub seed: u64,
}

/// What happened to one sample in one step.
#[derive(Clone, Debug, PartialEq)]
pub struct StepOutput {
    /// The request.
    pub request_id: u64,
    /// Which of its `n` samples: its sample index, `j` for sample `j` (`first + j` for a
    /// request added with [`Engine::add_request_with_sample_offset`]).
    pub sample_index: u32,
    /// The token chosen this step (`None` when sampling failed).
    pub token: Option<u32>,
    /// Its log-probability under the processed distribution.
    pub logprob: f64,
    /// The log-probabilities the request's [`SamplingParams::logprobs`] asked for (of the kind
    /// its `logprobs_kind` names: the chosen token's, and the `logprobs` most likely tokens,
    /// most likely first, ties toward the lower id); `None` when not asked or when sampling
    /// failed.
    pub logprobs: Option<nucleus_sampling::Logprobs>,
    /// Text this step released (may be empty: held back for UTF-8 or a possible stop string).
    pub text: String,
    /// Set when the sample finished this step.
    pub finish: Option<FinishReason>,
    /// The logits row the token was sampled from, when [`EngineConfig::capture_logits`].
    pub logits: Option<Vec<f32>>,
    /// On the step that finishes a sample whose request has a grammar: whether the grammar
    /// could end after the tokens committed (nucleus-grammar's `may_end`; true after EOS and
    /// when the grammar ended the sample). `false` for a sample cut by `max_tokens` or the
    /// context before its text was complete (such a text cannot match the grammar), and for
    /// one whose text a stop string ended (the text is not the tokens the grammar matched).
    /// `None` on other steps and without a grammar.
    pub grammar_complete: Option<bool>,
}

/// Engine options.
#[derive(Clone, Debug, Default)]
pub struct EngineConfig {
    /// Return each step's logits row in [`StepOutput::logits`] (tests, debugging).
    pub capture_logits: bool,
    /// The element type of the sequences' KV caches: f16 by default (as llama.cpp), f32 for
    /// keys and values exactly as computed ([`KvCacheDtype`]).
    pub kv_cache_dtype: KvCacheDtype,
}

/// Token counts and wall time, split into prefill and decode.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Metrics {
    /// Prompt tokens run through the model.
    pub prefill_tokens: usize,
    /// Time of steps that ran at least one prompt.
    pub prefill_time: Duration,
    /// Tokens sampled in pure decode steps.
    pub decode_tokens: usize,
    /// Time of pure decode steps.
    pub decode_time: Duration,
    /// All tokens sampled.
    pub generated_tokens: usize,
}

struct Sequence {
    request_id: u64,
    sample_index: u32,
    params: SamplingParams,
    prompt_ids: std::sync::Arc<Vec<u32>>,
    output_ids: Vec<u32>,
    cache: KvCache,
    /// Still to run through the model: the prompt before prefill, then the last token.
    pending: Vec<u32>,
    /// Samples `1..n` wait for sample 0's prefill, then copy its cache.
    forks: usize,
    max_tokens: usize,
    stop_token_ids: Vec<u32>,
    /// The ids that end the sample with [`FinishReason::Eos`] (none with `ignore_eos`).
    eos_token_ids: Vec<u32>,
    /// EOS and stop ids: banned by the sampler until `params.min_tokens` are generated.
    end_ids: Vec<u32>,
    decoder: IncrementalDecoder,
    stops: StopStrings,
    /// The request's stop strings (to restart [`Self::stops`] after a rollback).
    stop_strings: Vec<String>,
    /// [`Request::include_stop_str_in_output`].
    include_stop: bool,
    /// A stop string ended the text where it matched: the text is not the committed tokens'.
    cut_by_stop_string: bool,
    /// [`Request::skip_special_tokens`].
    skip_special: bool,
    /// [`Request::chain`], this sample's own clone.
    chain: Option<SamplerChain>,
    /// The sample's grammar state, when the request has a grammar.
    matcher: Option<GrammarMatcher>,
    /// With mirostat: `mu` after each generated token (the sampler's
    /// [`nucleus_sampling::SampleOutput::mirostat_mu`]), so a rollback restores it.
    mirostat_mus: Vec<f64>,
}

/// The generation loop over one model.
pub struct Engine {
    model: Box<dyn CausalLm>,
    tokenizer: ModelTokenizer,
    config: EngineConfig,
    seqs: Vec<Sequence>,
    next_request_id: u64,
    metrics: Metrics,
    /// Candidate ids per row: the tokenizer's vocabulary when the model's rows are padded.
    vocab_size: usize,
    /// Compiles and caches grammars for this tokenizer; built at the first grammar request.
    grammars: Option<Arc<GrammarCompiler>>,
    /// The tokenizer's byte tokens, so that broken UTF-8 is decoded lossily per maximal
    /// invalid subsequence (`None` for byte-level BPE).
    byte_tokens: Option<Arc<ByteTokens>>,
}

impl Engine {
    /// An engine over a loaded model and its tokenizer.
    pub fn new(model: Box<dyn CausalLm>, tokenizer: ModelTokenizer, config: EngineConfig) -> Self {
        let rows = model.config().vocab_size;
        let tok_vocab = tokenizer.tokenizer.get_vocab_size(true);
        let vocab_size = if tok_vocab > 0 && tok_vocab < rows {
            tok_vocab
        } else {
            rows
        };
        Self {
            model,
            config,
            seqs: Vec::new(),
            next_request_id: 0,
            metrics: Metrics::default(),
            vocab_size,
            grammars: None,
            byte_tokens: ByteTokens::new(&tokenizer.tokenizer),
            tokenizer,
        }
    }

    /// The engine's grammar compiler (built on first use from the tokenizer, its EOS id and
    /// the model's row width).
    ///
    /// # Errors
    /// [`EngineError::Grammar`] when the tokenizer cannot serve grammars (no EOS token, token
    /// bytes llguidance cannot take).
    pub fn grammar_compiler(&mut self) -> Result<&GrammarCompiler> {
        if self.grammars.is_none() {
            let eos = self.tokenizer.eos_token_ids.clone();
            let env = TokenEnv::from_tokenizer(
                &self.tokenizer.tokenizer,
                &eos,
                self.model.config().vocab_size,
            )?;
            self.grammars = Some(Arc::new(GrammarCompiler::new(env)?));
        }
        Ok(self.grammars.as_ref().expect("built above"))
    }

    /// The engine's grammar compiler, shared: a caller that compiles a request's grammar with
    /// it before [`Engine::add_request`] (on another thread: a server's request handler) fills
    /// the cache that `add_request` then reads, so a slow compilation does not hold the step
    /// loop.
    ///
    /// # Errors
    /// As [`Engine::grammar_compiler`].
    pub fn shared_grammar_compiler(&mut self) -> Result<Arc<GrammarCompiler>> {
        self.grammar_compiler()?;
        Ok(self.grammars.clone().expect("built above"))
    }

    /// The model.
    pub fn model(&self) -> &dyn CausalLm {
        self.model.as_ref()
    }

    /// The tokenizer.
    pub fn tokenizer(&self) -> &ModelTokenizer {
        &self.tokenizer
    }

    /// Counts and times so far.
    pub fn metrics(&self) -> &Metrics {
        &self.metrics
    }

    /// Whether any sample is still running.
    pub fn has_unfinished(&self) -> bool {
        !self.seqs.is_empty()
    }

    /// Tokenises text as a prompt (with the tokenizer's BOS).
    ///
    /// # Errors
    /// [`EngineError::Tokenizer`].
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        let enc = self
            .tokenizer
            .tokenizer
            .encode(text, true)
            .map_err(|e| EngineError::Tokenizer(e.to_string()))?;
        Ok(enc.get_ids().to_vec())
    }

    /// Decodes ids to text, special tokens skipped.
    ///
    /// # Errors
    /// [`EngineError::Tokenizer`].
    pub fn decode(&self, ids: &[u32]) -> Result<String> {
        self.tokenizer
            .tokenizer
            .decode(ids, true)
            .map_err(|e| EngineError::Tokenizer(e.to_string()))
    }

    /// Adds a request; it is prefilled in the next [`Engine::step`].
    ///
    /// # Errors
    /// [`EngineError::InvalidRequest`] for bad sampling parameters, `max_tokens == 0`,
    /// `n` outside `1..=MAX_SAMPLES_PER_REQUEST`, `params.n != 1` (the engine's samples are
    /// [`Request::n`]), an empty prompt, a prompt or stop token id
    /// outside the vocabulary, or a prompt that fills the model's context, `ignore_eos` with a
    /// grammar; [`EngineError::Tokenizer`]; [`EngineError::Sampling`] when no
    /// seed was given and the OS gave none; [`EngineError::Grammar`] when the grammar does
    /// not compile (the message names the problem).
    pub fn add_request(&mut self, request: Request) -> Result<RequestInfo> {
        self.add_request_with_sample_offset(request, 0)
    }

    /// [`Engine::add_request`], with sample `j` drawing from sample index `first + j` of the
    /// seed's stream (spec sampling.md, "Several samples per request") instead of `j`, and
    /// reported with that index in [`StepOutput::sample_index`]: a later request can then
    /// redraw one sample of an earlier one (same prompt and seed) on a stream of its own, as
    /// `nucleus generate --json-schema-retry` does with index `n * r + j` for retry `r` of
    /// sample `j`.
    ///
    /// # Errors
    /// As [`Engine::add_request`], and [`EngineError::InvalidRequest`] when `first + n - 1`
    /// does not fit in a `u32`.
    pub fn add_request_with_sample_offset(
        &mut self,
        request: Request,
        first: u32,
    ) -> Result<RequestInfo> {
        let invalid = |m: String| Err(EngineError::InvalidRequest(m));
        if let Err(e) = request.params.validate() {
            return invalid(e.to_string());
        }
        if request.max_tokens == 0 {
            return invalid("max_tokens must be at least 1".into());
        }
        if request.params.n != 1 {
            return invalid(format!(
                "params.n must be 1 in the engine (got {}): set Request::n, which forks the KV cache per sample",
                request.params.n
            ));
        }
        if request.n == 0 || request.n > MAX_SAMPLES_PER_REQUEST {
            return invalid(format!(
                "n must be in 1..={MAX_SAMPLES_PER_REQUEST}, got {}",
                request.n
            ));
        }
        if u32::try_from(request.n - 1)
            .ok()
            .and_then(|last| first.checked_add(last))
            .is_none()
        {
            return invalid(format!(
                "the sample indices {first} to {first} + {} do not fit in a u32",
                request.n - 1
            ));
        }
        if let Some(&bad) = request
            .stop_token_ids
            .iter()
            .find(|&&id| id as usize >= self.vocab_size)
        {
            return invalid(format!(
                "stop token id {bad} is not below the vocabulary size {}",
                self.vocab_size
            ));
        }
        let prompt_ids = match &request.prompt {
            Prompt::Text(text) => self.encode(text)?,
            Prompt::Tokens(ids) => ids.clone(),
        };
        if prompt_ids.is_empty() {
            return invalid("the prompt is empty and the tokenizer adds no BOS token".into());
        }
        if let Some(&bad) = prompt_ids
            .iter()
            .find(|&&id| id as usize >= self.vocab_size)
        {
            return invalid(format!(
                "prompt token id {bad} is not below the vocabulary size {}",
                self.vocab_size
            ));
        }
        let context = self.model.config().context_length;
        if prompt_ids.len() >= context {
            return invalid(format!(
                "the prompt has {} tokens, which leaves no room to generate in the model's \
                 context of {context} tokens",
                prompt_ids.len()
            ));
        }
        let compiled = match &request.grammar {
            Some(spec) => {
                if request.ignore_eos {
                    return invalid(
                        "ignore_eos cannot be combined with a grammar: EOS is where the grammar \
                         ends"
                            .into(),
                    );
                }
                let options = request.grammar_options;
                Some(self.grammar_compiler()?.compile(spec, &options)?)
            }
            None => None,
        };
        let mut params = request.params.clone();
        let seed = match params.seed {
            Some(seed) => seed,
            None => os_seed()?,
        };
        params.seed = Some(seed);
        let chain = match &request.chain {
            Some(chain) => {
                let n = chain.selection().n();
                if n != 1 {
                    return invalid(format!(
                        "the chain's selection draws {n} samples: it must draw 1 (set Request::n)"
                    ));
                }
                let mut chain = chain.clone();
                chain.set_selection(with_seed(*chain.selection(), seed));
                chain.reset(&prompt_ids);
                Some(chain)
            }
            None => None,
        };
        let request_id = self.next_request_id;
        self.next_request_id += 1;
        let prompt = std::sync::Arc::new(prompt_ids.clone());
        let eos_token_ids = if request.ignore_eos {
            Vec::new()
        } else {
            self.tokenizer.eos_token_ids.clone()
        };
        for j in 0..request.n {
            self.seqs.push(Sequence {
                request_id,
                // In range: checked above.
                sample_index: first + j as u32,
                params: params.clone(),
                prompt_ids: prompt.clone(),
                output_ids: Vec::new(),
                mirostat_mus: Vec::new(),
                cache: self.model.new_cache_of(self.config.kv_cache_dtype),
                pending: if j == 0 {
                    prompt_ids.clone()
                } else {
                    Vec::new()
                },
                forks: if j == 0 { request.n - 1 } else { 0 },
                max_tokens: request.max_tokens,
                stop_token_ids: request.stop_token_ids.clone(),
                end_ids: eos_token_ids
                    .iter()
                    .copied()
                    .chain(request.stop_token_ids.iter().copied())
                    .collect(),
                eos_token_ids: eos_token_ids.clone(),
                decoder: IncrementalDecoder::new(&prompt_ids)
                    .with_byte_tokens(self.byte_tokens.clone())
                    .skip_special_tokens(request.skip_special_tokens),
                stops: StopStrings::new(&request.stop_strings),
                stop_strings: request.stop_strings.clone(),
                include_stop: request.include_stop_str_in_output,
                cut_by_stop_string: false,
                skip_special: request.skip_special_tokens,
                chain: chain.clone(),
                matcher: compiled.as_ref().map(|g| g.matcher()),
            });
        }
        Ok(RequestInfo {
            request_id,
            prompt_ids,
            seed,
        })
    }

    /// Drops every sample of a request at once; no further [`StepOutput`] is produced for it
    /// (text held back for a possible stop string is discarded). Returns whether it was
    /// running.
    pub fn abort(&mut self, request_id: u64) -> bool {
        let before = self.seqs.len();
        self.seqs.retain(|s| s.request_id != request_id);
        self.seqs.len() != before
    }

    /// Undoes the last `n` generated tokens of a running sample, as for rejected speculative
    /// draft tokens: its output ids, its KV cache length, its grammar state (nucleus-grammar's
    /// rollback) and its detokeniser are restored to what they were `n` tokens ago, so the
    /// next [`Engine::step`] chooses token `len - n` again (from the same logits and Philox
    /// position: with the same parameters it draws the same token). Text already returned in a
    /// [`StepOutput`] is not taken back: the text released afterwards continues from the new
    /// end. `n == 0` does nothing.
    ///
    /// # Errors
    /// [`EngineError::InvalidRequest`] when no running sample has this request id and sample
    /// index, or `n` exceeds its generated tokens (nothing is changed then);
    /// [`EngineError::Grammar`] when its grammar cannot roll back.
    pub fn rollback(&mut self, request_id: u64, sample_index: u32, n: usize) -> Result<()> {
        let Some(seq) = self
            .seqs
            .iter_mut()
            .find(|s| s.request_id == request_id && s.sample_index == sample_index)
        else {
            return Err(EngineError::InvalidRequest(format!(
                "no running sample {sample_index} of request {request_id} to roll back"
            )));
        };
        let generated = seq.output_ids.len();
        if n > generated {
            return Err(EngineError::InvalidRequest(format!(
                "cannot roll back {n} tokens: sample {sample_index} of request {request_id} \
                 has generated {generated}"
            )));
        }
        if n == 0 {
            return Ok(());
        }
        if seq.chain.is_some() {
            return Err(EngineError::InvalidRequest(format!(
                "sample {sample_index} of request {request_id} samples with a chain, whose \
                 processors' state cannot be rolled back"
            )));
        }
        if let Some(m) = &mut seq.matcher {
            m.rollback(n)?;
        }
        seq.output_ids.truncate(generated - n);
        seq.mirostat_mus.truncate(generated - n);
        let total: Vec<u32> = seq
            .prompt_ids
            .iter()
            .chain(&seq.output_ids)
            .copied()
            .collect();
        // The cache holds every token but the last, which the next step runs through the model.
        seq.cache.truncate(total.len() - 1);
        seq.pending = vec![total[total.len() - 1]];
        seq.decoder = IncrementalDecoder::new(&total)
            .with_byte_tokens(self.byte_tokens.clone())
            .skip_special_tokens(seq.skip_special);
        seq.stops = StopStrings::new(&seq.stop_strings);
        Ok(())
    }

    /// Advances every live sample by one token: one forward pass over all of them, one batch
    /// sampling call. Returns one [`StepOutput`] per sample that took part, in the order the
    /// requests were added; finished samples leave the batch.
    ///
    /// # Errors
    /// A failure of the forward pass as a whole ([`EngineError::Candle`]). A failure that
    /// concerns one sample (sampling, detokenising) finishes that sample with
    /// [`FinishReason::Error`] and the others go on.
    pub fn step(&mut self) -> Result<Vec<StepOutput>> {
        let start = Instant::now();
        // Sequences that run through the model this step: everything but the forks-to-be.
        let runs: Vec<usize> = (0..self.seqs.len())
            .filter(|&i| !self.seqs[i].pending.is_empty())
            .collect();
        if runs.is_empty() {
            return Ok(Vec::new());
        }
        let prefill_tokens: usize = runs
            .iter()
            .map(|&i| &self.seqs[i])
            .filter(|s| s.output_ids.is_empty())
            .map(|s| s.pending.len())
            .sum();

        let row_len = self.model.config().vocab_size;
        let words = bitmask_words(row_len);
        // Every live sample is sampled this step (forks join their sample 0's row), so every
        // grammar sample needs its bitmask: slot `g` of `masks` for the g-th grammar sample in
        // `self.seqs` order.
        let grammar_slot: Vec<Option<usize>> = {
            let mut g = 0;
            self.seqs
                .iter()
                .map(|s| {
                    s.matcher.as_ref().map(|_| {
                        g += 1;
                        g - 1
                    })
                })
                .collect()
        };
        let n_grammar = grammar_slot.iter().flatten().count();
        let mut masks = vec![0u32; n_grammar * words];

        // The forward pass over all live rows and, on worker threads meanwhile, the grammar
        // samples' bitmasks (their matchers already hold every committed token).
        let (logits, fills) = {
            let mut inputs: Vec<SeqInput<'_>> = Vec::with_capacity(runs.len());
            let mut matchers: Vec<&mut GrammarMatcher> = Vec::with_capacity(n_grammar);
            let mut next_run = runs.iter().peekable();
            for (i, seq) in self.seqs.iter_mut().enumerate() {
                let Sequence {
                    pending,
                    cache,
                    matcher,
                    ..
                } = seq;
                if next_run.peek() == Some(&&i) {
                    next_run.next();
                    inputs.push(SeqInput {
                        tokens: pending,
                        cache,
                    });
                }
                if let Some(m) = matcher {
                    matchers.push(m);
                }
            }
            let model = &self.model;
            let mut forward = || -> Result<Vec<f32>> {
                let out = model.forward(&mut inputs)?;
                Ok(out.flatten_all()?.to_vec1::<f32>()?)
            };
            if matchers.is_empty() {
                (forward()?, Vec::new())
            } else {
                let (out, fills) = rayon::join(forward, || {
                    nucleus_grammar::fill_bitmasks(&mut matchers, &mut masks, words)
                });
                (out?, fills)
            }
        };

        // Forks: samples 1..n of a request just prefilled copy sample 0's cache and logits row.
        let mut rows: Vec<(usize, usize)> = Vec::new(); // (sequence, logits row)
        for (r, &i) in runs.iter().enumerate() {
            rows.push((i, r));
            let forks = std::mem::take(&mut self.seqs[i].forks);
            if forks > 0 {
                let (id, cache) = (self.seqs[i].request_id, self.seqs[i].cache.clone());
                for (k, seq) in self.seqs.iter_mut().enumerate() {
                    if k != i && seq.request_id == id && seq.output_ids.is_empty() {
                        seq.cache = cache.clone();
                        rows.push((k, r));
                    }
                }
            }
        }
        rows.sort_unstable_by_key(|&(k, _)| k);
        for seq in &mut self.seqs {
            seq.pending.clear();
        }

        let mut batch = Vec::with_capacity(rows.len() * row_len);
        for &(_, r) in &rows {
            batch.extend_from_slice(&logits[r * row_len..(r + 1) * row_len]);
        }
        let view = LogitsView::new(&batch, rows.len(), row_len, row_len, self.vocab_size)
            .map_err(|e| EngineError::InvalidRequest(e.to_string()))?;
        // Rows sampled by a chain are sampled one by one below; the others in one batch.
        let plain: Vec<usize> = (0..rows.len())
            .filter(|&r| self.seqs[rows[r].0].chain.is_none())
            .collect();
        let plain_batch;
        let view = if plain.len() == rows.len() {
            view
        } else {
            let mut b = Vec::with_capacity(plain.len() * row_len);
            for &r in &plain {
                b.extend_from_slice(&batch[r * row_len..(r + 1) * row_len]);
            }
            plain_batch = b;
            LogitsView::new(&plain_batch, plain.len(), row_len, row_len, self.vocab_size)
                .map_err(|e| EngineError::InvalidRequest(e.to_string()))?
        };
        let requests: Vec<SampleRequest<'_>> = plain
            .iter()
            .map(|&r| rows[r])
            .map(|(k, _)| {
                let s = &self.seqs[k];
                SampleRequest {
                    params: &s.params,
                    prompt_ids: &s.prompt_ids,
                    output_ids: &s.output_ids,
                    position: (s.prompt_ids.len() + s.output_ids.len()) as u64,
                    sample_index: s.sample_index,
                    stop_token_ids: &s.end_ids,
                    token_bitmask: grammar_slot[k].map(|g| &masks[g * words..(g + 1) * words]),
                    mirostat_mu: s.mirostat_mus.last().copied(),
                }
            })
            .collect();
        let sampled_plain = if plain.is_empty() {
            Vec::new()
        } else {
            sample_batch(&view, &requests)
                .map_err(|e| EngineError::InvalidRequest(e.to_string()))?
        };
        drop(requests);
        let mut sampled_plain = sampled_plain.into_iter();
        let vocab = self.vocab_size;
        let sampled: Vec<_> = rows
            .iter()
            .enumerate()
            .map(|(r, &(k, _))| {
                let seq = &mut self.seqs[k];
                let Some(chain) = seq.chain.as_mut() else {
                    return sampled_plain
                        .next()
                        .unwrap_or(Err(nucleus_sampling::SampleError::NoCandidates));
                };
                let position = (seq.prompt_ids.len() + seq.output_ids.len()) as u64;
                let mut ctx = ProcessorContext::new(&seq.prompt_ids, &seq.output_ids, position)
                    .with_stop_token_ids(&seq.end_ids);
                if let Some(g) = grammar_slot[k] {
                    ctx = ctx.with_token_bitmask(&masks[g * words..(g + 1) * words]);
                }
                let row = &batch[r * row_len..r * row_len + vocab];
                chain.sample(row, &ctx, seq.sample_index)
            })
            .collect();

        let context = self.model.config().context_length;
        let mut outputs = Vec::with_capacity(rows.len());
        let mut finished = Vec::new();
        for (row, (&(k, _), result)) in rows.iter().zip(sampled).enumerate() {
            let seq = &mut self.seqs[k];
            let mut out = StepOutput {
                request_id: seq.request_id,
                sample_index: seq.sample_index,
                token: None,
                logprob: 0.0,
                logprobs: None,
                text: String::new(),
                finish: None,
                logits: self
                    .config
                    .capture_logits
                    .then(|| batch[row * row_len..(row + 1) * row_len].to_vec()),
                grammar_complete: None,
            };
            let fill = grammar_slot[k].map(|g| &fills[g]);
            match (result, fill) {
                (_, Some(Err(e))) => {
                    out.finish = Some(FinishReason::Error(format!(
                        "grammar: cannot compute the allowed tokens: {e}"
                    )))
                }
                (Err(e), _) => out.finish = Some(FinishReason::Error(e.to_string())),
                (Ok(s), _) => {
                    // Validate before commit: a token the grammar rejects is never committed.
                    let rejected = seq.matcher.as_mut().and_then(|m| m.commit(s.token).err());
                    if let Some(e) = rejected {
                        out.finish = Some(FinishReason::Error(format!(
                            "grammar: the sampled token was not committed: {e}"
                        )));
                    } else {
                        out.token = Some(s.token);
                        out.logprob = s.logprob;
                        out.logprobs = s.logprobs;
                        seq.output_ids.push(s.token);
                        if let Some(chain) = &mut seq.chain {
                            chain.accept(s.token);
                        }
                        if let Some(mu) = s.mirostat_mu {
                            seq.mirostat_mus.push(mu);
                        }
                        // A grammar that can take no more text ends the sample (before
                        // min_tokens, which would otherwise ban the only token it allows, and
                        // before max_tokens: the text is complete).
                        let grammar_ended = seq.matcher.as_ref().is_some_and(|m| m.is_ended());
                        out.finish = advance(
                            seq,
                            s.token,
                            &self.tokenizer,
                            context,
                            grammar_ended,
                            &mut out.text,
                        );
                    }
                }
            }
            if out.finish.is_some() {
                // A text cut by a stop string is not the tokens the grammar matched.
                let cut = seq.cut_by_stop_string;
                out.grammar_complete = seq.matcher.as_mut().map(|m| !cut && m.may_end());
                finished.push(k);
            }
            outputs.push(out);
        }
        let mut k = 0;
        self.seqs.retain(|_| {
            k += 1;
            !finished.contains(&(k - 1))
        });

        let elapsed = start.elapsed();
        self.metrics.generated_tokens += outputs.iter().filter(|o| o.token.is_some()).count();
        if prefill_tokens > 0 {
            self.metrics.prefill_tokens += prefill_tokens;
            self.metrics.prefill_time += elapsed;
        } else {
            self.metrics.decode_tokens += outputs.len();
            self.metrics.decode_time += elapsed;
        }
        Ok(outputs)
    }
}

/// Applies one sampled token to a sequence: stop conditions (EOS, stop ids and strings, the
/// grammar's end when `grammar_ended`, then length), text. Returns the finish reason.
fn advance(
    seq: &mut Sequence,
    token: u32,
    tokenizer: &ModelTokenizer,
    context: usize,
    grammar_ended: bool,
    text: &mut String,
) -> Option<FinishReason> {
    let finish = |seq: &mut Sequence, text: &mut String, reason: FinishReason| {
        finish_sample(seq, tokenizer, text, reason)
    };
    if seq.eos_token_ids.contains(&token) {
        return Some(finish(seq, text, FinishReason::Eos));
    }
    if seq.stop_token_ids.contains(&token) {
        return Some(finish(seq, text, FinishReason::Stop));
    }
    match seq.decoder.push(tokenizer, token) {
        // Before `min_tokens` stop strings are not looked for (vLLM's `check_stop`), as stop
        // ids are banned until then.
        Ok(delta) if seq.output_ids.len() < seq.params.min_tokens => text.push_str(&delta),
        Ok(delta) => {
            let check = seq.stops.push(&delta);
            text.push_str(&check.text);
            if check.stopped {
                seq.cut_by_stop_string = true;
                if seq.include_stop {
                    text.push_str(check.matched.as_deref().unwrap_or_default());
                }
                return Some(FinishReason::Stop);
            }
        }
        Err(e) => return Some(FinishReason::Error(e.to_string())),
    }
    if grammar_ended {
        return Some(finish(seq, text, FinishReason::Stop));
    }
    let len = seq.prompt_ids.len() + seq.output_ids.len();
    if seq.output_ids.len() >= seq.max_tokens || len >= context {
        return Some(finish(seq, text, FinishReason::Length));
    }
    seq.pending.push(token);
    None
}

/// Ends a sample: releases the text held back (an incomplete UTF-8 tail, a possible stop
/// string prefix) into `text`. A stop string completed by that tail makes the reason `Stop`.
fn finish_sample(
    seq: &mut Sequence,
    tokenizer: &ModelTokenizer,
    text: &mut String,
    reason: FinishReason,
) -> FinishReason {
    let rest = match seq.decoder.finish(tokenizer) {
        Ok(rest) => rest,
        Err(e) => return FinishReason::Error(e.to_string()),
    };
    let check = seq.stops.push(&rest);
    text.push_str(&check.text);
    if check.stopped {
        seq.cut_by_stop_string = true;
        if seq.include_stop {
            text.push_str(check.matched.as_deref().unwrap_or_default());
        }
        return FinishReason::Stop;
    }
    text.push_str(&seq.stops.take_pending());
    reason
}

/// `selection` drawing from the stream of `seed` when it has no seed of its own.
fn with_seed(selection: Selection, seed: u64) -> Selection {
    match selection {
        Selection::Sample {
            seed: None,
            n,
            logprobs,
            logprobs_kind,
        } => Selection::Sample {
            seed: Some(seed),
            n,
            logprobs,
            logprobs_kind,
        },
        Selection::Mirostat {
            tau,
            eta,
            m,
            seed: None,
            n,
            logprobs,
            logprobs_kind,
        } => Selection::Mirostat {
            tau,
            eta,
            m,
            seed: Some(seed),
            n,
            logprobs,
            logprobs_kind,
        },
        Selection::MirostatV2 {
            tau,
            eta,
            seed: None,
            n,
            logprobs,
            logprobs_kind,
        } => Selection::MirostatV2 {
            tau,
            eta,
            seed: Some(seed),
            n,
            logprobs,
            logprobs_kind,
        },
        Selection::AdaptiveP {
            target,
            decay,
            seed: None,
            n,
            logprobs,
            logprobs_kind,
        } => Selection::AdaptiveP {
            target,
            decay,
            seed: Some(seed),
            n,
            logprobs,
            logprobs_kind,
        },
        other => other,
    }
}
