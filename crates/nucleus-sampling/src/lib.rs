//! # nucleus-sampling
//!
//! Logits processing and token selection for the decode step of LLM inference: from a logits
//! matrix `[batch, vocab]` to one token per request, exactly to the contract in
//! `spec/sampling.md` (the project's shared specification), whatever the batch size, the row's
//! place in the batch or the thread count.
//!
//! Key types:
//! - [`LogitsView`]: a borrowed, checked `[batch, row_len]` f32 matrix with a row stride and a
//!   `vocab_size` that may be smaller than the row (padded embedding tables).
//! - [`SamplingParams`]: one request's parameters (temperature, top_k, top_p, min_p,
//!   repetition / presence / frequency penalties, logit_bias, allowed_token_ids, bad_words,
//!   min_tokens, seed), validated by [`SamplingParams::validate`].
//! - [`InputKind`]: rows of logits (default) or of probabilities (`*_from_probs`); rows may be
//!   f32, f16 or bf16 ([`LogitValue`]).
//! - [`SampleRequest`]: parameters plus context (prompt ids, generated ids, position, sample
//!   index) for one row.
//! - [`sample_batch`]: samples every row (rows in parallel on the current rayon pool) and returns
//!   one `Result` per row; [`sample_row`] does one row; [`distribution`] returns the exact
//!   final probabilities that selection draws from.
//! - [`TokenBitmask`] (module [`bitmask`]): the structured-output mask, `[batch,
//!   ceil(row_len / 32)]` u32 words in XGrammar / llguidance's layout, applied in place by
//!   [`apply_token_bitmask_inplace`] or by the sampler at step 3
//!   ([`SampleRequest::with_token_bitmask`]).
//! - [`philox`]: the counter-based Philox4x32-10 generator behind every random draw.
//! - [`SamplerChain`] (module [`chain`]): the same steps as composable processors, in any
//!   order, ending in a [`Selection`] (sample or greedy), like llama.cpp's sampler chain.
//!   [`LogitsProcessor`] is the trait a processor implements (apply / reset / accept / clone),
//!   so users can add their own; [`ProcessorConfig`] is a chain's configuration as serde data
//!   (JSON such as `[{"top_k": {"k": 50}}, {"temperature": {"t": 0.8}}, {"sample": {"seed": 42}}]`);
//!   [`SamplerChain::from_params`] is the fixed `SamplingParams` path as a chain.
//!   The catalogue (one file per family in `chain/`): constraints (forced BOS/EOS, suppress
//!   tokens, inf/nan removal), penalties (sequence bias, encoder repetition penalty,
//!   exponential decay length penalty), temperature and entropy (dynamic temperature, typical,
//!   eta, top-h, log-softmax), filters (min-p, top-k, top-p, top-n-sigma, epsilon, all with
//!   `min_keep`), repetition avoidance (DRY, no-repeat-ngram) and stochastic ones (XTC; the
//!   selections mirostat v1/v2 and adaptive-p). Requests whose [`SamplingParams`] set an
//!   extended field (spec/sampling.md, "Extended processors in the fixed path") run on
//!   [`SamplerChain::from_params`] inside [`sample_row`] / [`sample_batch`].
//! - [`top_k_top_p_sample`] (module [`npu`]): the fused top-k -> top-p -> min-p ->
//!   exponential-sampling operator with the semantics of Ascend's
//!   `torch_npu.npu_top_k_top_p_sample` (`spec/npu_top_k_top_p_sample.md`), exact and in
//!   linear time per row.
//!
//! A decode step:
//!
//! ```
//! use nucleus_sampling::{sample_batch, LogitsView, SampleRequest, SamplingParams};
//!
//! let vocab = 4;
//! let logits = [1.0f32, 3.0, 2.0, -1.0, /* row 1 */ 0.5, 0.5, 4.0, 0.0];
//! let view = LogitsView::dense(&logits, 2, vocab).unwrap();
//! let greedy = SamplingParams::greedy();
//! let nucleus = SamplingParams { temperature: 0.7, top_p: 0.9, seed: Some(7), ..Default::default() };
//! let prompt = [1u32, 2];
//! let requests = [
//!     SampleRequest::new(&greedy, &prompt, &[], 2),
//!     SampleRequest::new(&nucleus, &prompt, &[], 2),
//! ];
//! let results = sample_batch(&view, &requests).unwrap();
//! assert_eq!(results[0].as_ref().unwrap().token, 1);
//! assert!(results[1].is_ok());
//! ```
//!
//! The order of operations (spec/sampling.md): 1. row check (NaN/+inf is an error for that
//! row), 3. hard constraints (allowed_token_ids, bad_words, min_tokens, the token bitmask) set -inf, 4. logit_bias
//! (clamped to ±100), 5. repetition penalty, then frequency and presence penalties, 6. greedy
//! when temperature < 1e-5, 7. temperature, 8. min_p, 9. top-k (exact k, ties to the lower id),
//! 10. top-p (smallest prefix reaching p), 11. inverse-CDF selection in token-id order with one
//! uniform from the request's Philox stream, 12. no candidate is an error. No path sorts the
//! vocabulary: the k-th value and the top-p boundary are found in linear time.

#![warn(missing_docs)]

pub mod bitmask;
pub mod chain;
mod error;
mod kernels;
pub mod npu;
mod params;
pub mod philox;
mod sampler;
pub mod speculative;
mod view;

pub use bitmask::{
    apply_token_bitmask_inplace, apply_token_bitmask_inplace_batch, bitmask_words, TokenBitmask,
};
pub use chain::{
    ChainError, LogitsProcessor, ProcessorConfig, ProcessorContext, SamplerChain, Selection,
};
pub use error::{BitmaskError, ParamError, SampleError, ShapeError};
pub use npu::{
    top_k_top_p_sample, QIndexing, TopKTopPError, TopKTopPRowError, TopKTopPSampleOptions,
    TopKTopPSampleOutput,
};
pub use params::{LogprobsKind, SamplingParams, GREEDY_TEMPERATURE, LOGIT_BIAS_LIMIT, MAX_N};
pub use sampler::{
    distribution, distribution_from_probs, os_seed, sample_batch, sample_row,
    sample_row_from_probs, Logprobs, Sample, SampleOutput, SampleRequest, TokenLogprob,
};
pub use view::{InputKind, LogitValue, LogitsView};
