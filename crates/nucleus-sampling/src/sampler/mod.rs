//! The `SamplingParams` path: one fixed chain of spec/sampling.md steps 1 and 3-12, in linear
//! time per row (no sort of the vocabulary), reading the row about once.
//!
//! How a row is processed (the passes are in [`crate::kernels`] or use its masks: AVX-512,
//! AVX2 or SSE2 chosen at run time, bitwise the same results):
//! 1. Row check (step 1) inside the first pass: NaN and +inf set a bit of the compare masks.
//! 2. Steps 3-5. For greedy and top-k with few modified ids (bad words, stop ids under
//!    `min_tokens`, biased and penalised ids): the scan skips those ids and they are added back
//!    with their modified values (exact: the best `k` of the unmodified ids plus the modified
//!    ones contain the best `k` of the row). Otherwise a per-thread copy of the row is
//!    modified. The caller's logits are never written.
//! 3. Greedy (step 6) and top-k (step 9): one pass of vector compares against a rising
//!    threshold; a candidate enters a buffer of u64 rank keys (logit descending, id ascending)
//!    that a linear-time selection cuts back to `k` whenever it doubles. Exactly `k` tokens,
//!    ties to the lower id.
//! 4. Min-p alone (step 8): one pass keeping a window below the running maximum; then the exact
//!    test `(l - max) / T >= ln(min_p)` in f64.
//! 5. Top-p alone (step 10): one online pass computes the maximum and the normaliser `z`
//!    (16 lanes, f64 per block); the tokens ranked at or below the boundary weigh more than
//!    `(1 - p) z`, so the boundary's weight is at least `(1 - p) z / vocab`, and only tokens
//!    above that cut are collected (a second, compare-only pass) for a mass-aware quickselect
//!    (f64 sums).
//! 6. Whatever the filters, the survivors form a prefix of the (logit desc, id asc) order, so
//!    they are either a short list (sorted by id) or "every finite logit ranked at or above a
//!    boundary (logit, id)", tested in one pass over the row.
//! 7. Selection (step 11) walks the survivors in id order with one uniform from the request's
//!    Philox stream. Weights are `exp((l - max) / T)` in f32 (a polynomial exp without fused
//!    multiply-adds, so every instruction set gives the same bits); masses are f64 sums over
//!    fixed chunks of [`CHUNK`] ids.
//! 8. When the batch leaves threads idle, a long row's passes are split across the pool by
//!    whole chunks and merged in chunk order: the same bits on any thread count.
//!
//! Ordering decisions (top-k, top-p) use the penalised logits before temperature: dividing by
//! a positive temperature keeps the order, and the logits keep distinctions that f32 rounding
//! of `(l - max) / T` could erase.
//!
//! The files, by stage of that fast path (spec/sampling.md step numbers):
//! - `mod.rs` (this file): the request and output types, [`sample_batch`], [`sample_row`],
//!   [`distribution`] and the candidate type [`Cand`] with its rank order (steps 9-10's
//!   "logit desc, id asc"); drawing the `n` samples (step 11's uniforms).
//! - `check.rs`: step 1 and the checks of the parameters and the context ids.
//! - `modify.rs`: steps 3-5 (hard constraints, logit_bias, penalties) on a dense copy of the
//!   row or on the sparse list of modified ids.
//! - `prepare.rs`: the per-thread scratch and the row pass that runs steps 1-10 in order
//!   (greedy, temperature, min-p, top-k, top-p) and leaves the support.
//! - `scan.rs`: the vectorised passes over the whole row (`scan_top`, `scan_window`,
//!   `collect`, `first_at_least`, the max / sum-of-exp passes) and their x86 bodies, split
//!   across the pool by whole chunks.
//! - `select.rs`: top-k candidates (step 9), the smallest-set top-p prefix (step 10), the
//!   chunked f64 sums and the inverse-CDF selection (step 11).
//! - `logprobs.rs`: raw (step 2) and processed log-probabilities ("Outputs").

use std::cell::RefCell;
use std::cmp::Ordering;

use rayon::prelude::*;

use crate::error::{SampleError, ShapeError};
use crate::params::{LogprobsKind, SamplingParams};
use crate::philox;
use crate::view::{InputKind, LogitValue, LogitsView};

mod check;
mod extended;
mod logprobs;
mod modify;
mod prepare;
mod scan;
mod select;

pub(crate) use check::non_finite;
pub(crate) use logprobs::{dense_top_logprobs, processed_logprobs_from, raw_logprobs};
pub(crate) use modify::repetition_penalized;
// Not used outside the sampler today; kept at their paths of the single-file sampler.
#[allow(unused_imports)]
pub(crate) use logprobs::{fill_impossible, top_values};
pub(crate) use scan::{collect, first_at_least, scan_top};
pub(crate) use select::{chunked_sum, dense_sum, select_dense, top_p_prefix};

use logprobs::processed_logprobs;
pub(crate) use prepare::logit_cut;
use prepare::{prepare, with_scratch, Scratch, Support};
use select::select_sparse;

/// Ids per chunk of the f64 mass sums (spec/sampling.md: chunking independent of threads).
pub(crate) const CHUNK: usize = 8192;

/// Rows at least this long have their passes split across the rayon pool's threads when the
/// batch leaves threads idle (batch 1, typically). Chunks of [`CHUNK`] ids are the unit, so
/// the results are the same bits as unsplit. Shorter rows are not split: their passes take
/// 10-80 µs, and waking a sleeping pool thread costs 20-30 µs on the project's machines, so a
/// split 151,936-id row was slower than an unsplit one there (BENCHMARKS.md), while a
/// 1,048,576-id row was 1.3x to 1.6x faster on two threads.
const SPLIT_MIN: usize = 64 * CHUNK;

/// The length of the pieces a split row is cut into: one per thread of the current pool, a
/// whole number of [`CHUNK`]s (so every chunk-structured sum is the same).
fn piece(len: usize) -> usize {
    let chunks = len.div_ceil(CHUNK).max(1);
    chunks.div_ceil(rayon::current_num_threads().max(1)) * CHUNK
}

/// A survivor list shorter than `vocab / LIST_FRACTION` is sorted by id; a longer one is
/// found again by one boundary pass over the row.
const LIST_FRACTION: usize = 16;

/// One row's request: parameters and the context the penalties and the random stream need.
#[derive(Clone, Copy, Debug)]
pub struct SampleRequest<'a> {
    /// The request's parameters.
    pub params: &'a SamplingParams,
    /// Prompt token ids (the repetition penalty counts them). Each must be below `vocab_size`.
    pub prompt_ids: &'a [u32],
    /// Token ids generated so far. Each must be below `vocab_size`.
    pub output_ids: &'a [u32],
    /// Index, in the whole sequence (prompt included), of the token being chosen: the Philox
    /// counter's position words.
    pub position: u64,
    /// Which of the request's `n` samples this is: the Philox counter's third word.
    pub sample_index: u32,
    /// The request's EOS and stop token ids: banned while fewer than `params.min_tokens`
    /// tokens have been generated (spec step 3). Each must be below `vocab_size`.
    pub stop_token_ids: &'a [u32],
    /// A structured-output token bitmask row ([`crate::bitmask`] layout: token `t` is bit
    /// `t % 32` of word `t / 32`, set = allowed), applied at spec step 3 to the sampler's copy
    /// of the row (the caller's logits are not changed). At least `ceil(vocab_size / 32)`
    /// words; words past the vocabulary (a padded row's) are not read. `None`: no mask.
    pub token_bitmask: Option<&'a [u32]>,
    /// Mirostat's `mu` before this step, carried per request by the caller from the previous
    /// step's [`SampleOutput::mirostat_mu`] (spec/sampling.md, "Extended processors": "its
    /// `mu` carried per request"). `None`: the start value `2 * mirostat_tau`. Read only when
    /// [`SamplingParams::mirostat`] is 1 or 2.
    pub mirostat_mu: Option<f64>,
}

impl<'a> SampleRequest<'a> {
    /// A request for sample 0 at `position`.
    pub fn new(
        params: &'a SamplingParams,
        prompt_ids: &'a [u32],
        output_ids: &'a [u32],
        position: u64,
    ) -> Self {
        Self {
            params,
            prompt_ids,
            output_ids,
            position,
            sample_index: 0,
            stop_token_ids: &[],
            token_bitmask: None,
            mirostat_mu: None,
        }
    }

    /// The same request with mirostat's `mu` carried from the previous step.
    pub fn with_mirostat_mu(mut self, mu: f64) -> Self {
        self.mirostat_mu = Some(mu);
        self
    }

    /// The same request with this token bitmask row (see [`Self::token_bitmask`]).
    pub fn with_token_bitmask(mut self, bitmask: &'a [u32]) -> Self {
        self.token_bitmask = Some(bitmask);
        self
    }

    /// The same request with these EOS and stop ids (for `min_tokens`).
    pub fn with_stop_token_ids(mut self, stop_token_ids: &'a [u32]) -> Self {
        self.stop_token_ids = stop_token_ids;
        self
    }

    /// The same request for sample `sample_index` of `n`.
    pub fn with_sample_index(mut self, sample_index: u32) -> Self {
        self.sample_index = sample_index;
        self
    }
}

/// The result of sampling one row.
#[derive(Clone, Debug, PartialEq)]
pub struct SampleOutput {
    /// The chosen token id (below `vocab_size`): sample `sample_index` of the request.
    pub token: u32,
    /// Natural log of the chosen token's probability under the processed (final) distribution;
    /// 0 for greedy.
    pub logprob: f64,
    /// Number of tokens with non-zero final probability (1 for greedy).
    pub num_candidates: usize,
    /// The seed used: the request's, or the one drawn from the OS when it had none.
    pub seed: u64,
    /// Samples `sample_index + 1 .. sample_index + n` of a request with
    /// [`SamplingParams::n`] `> 1`, drawn from the same distribution as [`Self::token`];
    /// empty when `n = 1` (no allocation).
    pub extra_samples: Vec<Sample>,
    /// The log-probabilities asked for with [`SamplingParams::logprobs`]; `None` when not asked.
    pub logprobs: Option<Logprobs>,
    /// With [`SamplingParams::mirostat`] 1 or 2: `mu` after [`Self::token`] is accepted
    /// (`mu - eta * (-log2 p(token) - tau)`, p under the truncated distribution), to pass as the
    /// next step's [`SampleRequest::mirostat_mu`]. `None` otherwise (greedy included).
    pub mirostat_mu: Option<f64>,
}

impl SampleOutput {
    /// Every sampled token in sample order: [`Self::token`], then [`Self::extra_samples`].
    pub fn tokens(&self) -> impl Iterator<Item = u32> + '_ {
        std::iter::once(self.token).chain(self.extra_samples.iter().map(|s| s.token))
    }
}

/// One of several samples drawn from one row ([`SamplingParams::n`]).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Sample {
    /// The chosen token id.
    pub token: u32,
    /// Its natural-log probability under the processed distribution (0 for greedy).
    pub logprob: f64,
}

/// A token and its log-probability (natural log; `-inf` for a token that cannot be chosen).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct TokenLogprob {
    /// The token id.
    pub token_id: u32,
    /// Its natural-log probability under the distribution named by [`Logprobs::kind`].
    pub logprob: f64,
}

/// Log-probabilities reported for one row (spec/sampling.md, "Outputs").
#[derive(Clone, Debug, PartialEq)]
pub struct Logprobs {
    /// Which distribution the values come from: raw (step 2) or processed (step 11).
    pub kind: LogprobsKind,
    /// The log-probability of each sampled token, in sample order ([`SampleOutput::tokens`]).
    pub sampled: Vec<f64>,
    /// The [`SamplingParams::logprobs`] most likely tokens, most likely first, ties toward the
    /// lower id; tokens that cannot be chosen come last with `-inf`, by ascending id.
    pub top: Vec<TokenLogprob>,
}

/// Samples one token per row of `logits`: rows in parallel on the current rayon pool (use
/// `pool.install(|| sample_batch(..))` to choose the pool).
///
/// Arguments: `logits` `[batch, row_len]` f32, f16 or bf16, logits or probabilities
/// ([`LogitsView::kind`]), with `vocab_size` candidate ids per row; `requests`, one per row,
/// in row order.
///
/// Returns one `Result` per row, in row order. A row's result depends only on its logits and
/// its request, never on the other rows or the thread count.
///
/// Randomness: one uniform per row from Philox4x32-10 at (seed, position, sample_index)
/// ([`philox::uniform`]); greedy rows draw nothing.
///
/// # Errors
/// [`ShapeError::RequestCountMismatch`] when `requests.len() != logits.batch()`. Per-row
/// errors are in the returned vector (see [`sample_row`]).
pub fn sample_batch<T: LogitValue>(
    logits: &LogitsView<'_, T>,
    requests: &[SampleRequest<'_>],
) -> Result<Vec<Result<SampleOutput, SampleError>>, ShapeError> {
    if requests.len() != logits.batch() {
        return Err(ShapeError::RequestCountMismatch {
            requests: requests.len(),
            batch: logits.batch(),
        });
    }
    // Fewer rows than threads: split each long row's passes across the idle threads.
    let split = logits.batch() < rayon::current_num_threads();
    Ok(requests
        .par_iter()
        .enumerate()
        .map(|(i, request)| match T::as_f32(logits.row(i)) {
            Some(row) => sample_kind(row, logits.kind(), request, split),
            None => with_widened(logits.row(i), |row| {
                sample_kind(row, logits.kind(), request, split)
            }),
        })
        .collect())
}

/// Samples one row: `row` holds the `vocab_size = row.len()` candidate logits (f32).
///
/// Applies spec/sampling.md steps 1 and 3-12 in that order; see the crate docs. The caller's logits are not modified (the penalty works on a per-thread copy).
///
/// # Errors
/// - [`SampleError::InvalidParams`]: a parameter out of range (checked first).
/// - [`SampleError::TokenIdOutOfRange`]: a prompt or output id `>= row.len()`.
/// - [`SampleError::NonFiniteLogits`]: a NaN or +inf logit.
/// - [`SampleError::NoCandidates`]: every logit is -inf, or the row is empty.
/// - [`SampleError::PenaltyOverflow`]: the repetition penalty took a logit out of the f32 range.
/// - [`SampleError::SeedUnavailable`]: no seed was given and the OS gave none.
pub fn sample_row(row: &[f32], request: &SampleRequest<'_>) -> Result<SampleOutput, SampleError> {
    sample_kind(row, InputKind::Logits, request, true)
}

/// [`sample_row`] for a row of probabilities ([`InputKind::Probs`]): non-negative weights,
/// renormalised by the sampler; zeros are never chosen. Masks, min_p, top_k and top_p apply;
/// penalties and logit_bias are an error; temperature must be 1 or greedy.
///
/// # Errors
/// As [`sample_row`], with [`SampleError::InvalidProbability`] for a NaN, infinite or
/// negative value and [`SampleError::InvalidParams`] for parameters defined on logits only.
pub fn sample_row_from_probs(
    probs: &[f32],
    request: &SampleRequest<'_>,
) -> Result<SampleOutput, SampleError> {
    sample_kind(probs, InputKind::Probs, request, true)
}

/// `split`: the row's passes may be split across the current rayon pool (when it is long
/// enough; see [`SPLIT_MIN`]). The result is the same either way.
fn sample_kind(
    row: &[f32],
    kind: InputKind,
    request: &SampleRequest<'_>,
    split: bool,
) -> Result<SampleOutput, SampleError> {
    let params = request.params;
    if params.uses_extended() {
        return extended::sample(row, kind, request);
    }
    let seed = match params.seed {
        Some(seed) => seed,
        None => os_seed()?,
    };
    if params.n > 1
        && request
            .sample_index
            .checked_add(params.n as u32 - 1)
            .is_none()
    {
        return Err(SampleError::InvalidParams(crate::error::ParamError::new(
            "n",
            params.n,
            "at most u32::MAX + 1 - sample_index (the sample indices must fit a u32)",
        )));
    }
    if let Some(top) = params.logprobs {
        if top > row.len() {
            return Err(SampleError::InvalidParams(crate::error::ParamError::new(
                "logprobs",
                top,
                "at most vocab_size",
            )));
        }
    }
    with_scratch(|scratch| {
        let prepared = prepare(row, kind, request, scratch, split)?;
        let draw = |j: usize, scratch: &Scratch| -> (u32, f32, f64, usize) {
            match prepared.support {
                Support::Greedy(token) => (token, 1.0, 1.0, 1),
                Support::List(n) => {
                    let u =
                        philox::uniform(seed, request.position, request.sample_index + j as u32);
                    select_sparse(&scratch.cand[..n], u)
                }
                Support::Dense => {
                    let u =
                        philox::uniform(seed, request.position, request.sample_index + j as u32);
                    select_dense(&scratch.weights[..row.len()], u)
                }
            }
        };
        let (token, weight, z, num_candidates) = draw(0, scratch);
        let logprob = (f64::from(weight) / z).ln();
        let extra_samples = (1..params.n)
            .map(|j| {
                let (token, weight, z, _) = draw(j, scratch);
                Sample {
                    token,
                    logprob: (f64::from(weight) / z).ln(),
                }
            })
            .collect::<Vec<_>>();
        let mut output = SampleOutput {
            token,
            logprob,
            num_candidates,
            seed,
            extra_samples,
            logprobs: None,
            mirostat_mu: None,
        };
        if let Some(top) = params.logprobs {
            output.logprobs = Some(match params.logprobs_kind {
                LogprobsKind::Processed => {
                    processed_logprobs(&prepared, row.len(), scratch, &output, top)
                }
                LogprobsKind::Raw => raw_logprobs(row, kind, &output, top),
            });
        }
        Ok(output)
    })
}

/// The exact final probabilities that [`sample_row`] draws from: a vector of `row.len()` f64
/// values, zero for removed tokens, summing to 1 (one-hot on the argmax for greedy).
///
/// Probability `i` is `w_i / Z` with `w_i = exp((l_i - max) / T)` computed in f32 exactly as
/// the sampler computes it and `Z` the f64 sum of the survivors' weights: this is the oracle
/// for logprobs, speculative decoding and tests.
///
/// # Errors
/// As [`sample_row`], except that no seed is needed.
pub fn distribution(row: &[f32], request: &SampleRequest<'_>) -> Result<Vec<f64>, SampleError> {
    distribution_kind(row, InputKind::Logits, request, true)
}

/// [`distribution`] for a row of probabilities (see [`sample_row_from_probs`]).
///
/// # Errors
/// As [`sample_row_from_probs`].
pub fn distribution_from_probs(
    probs: &[f32],
    request: &SampleRequest<'_>,
) -> Result<Vec<f64>, SampleError> {
    distribution_kind(probs, InputKind::Probs, request, true)
}

fn distribution_kind(
    row: &[f32],
    kind: InputKind,
    request: &SampleRequest<'_>,
    split: bool,
) -> Result<Vec<f64>, SampleError> {
    if request.params.uses_extended() {
        return extended::distribution(row, kind, request);
    }
    with_scratch(|scratch| {
        let prepared = prepare(row, kind, request, scratch, split)?;
        let mut out = vec![0.0f64; row.len()];
        match prepared.support {
            Support::Greedy(token) => out[token as usize] = 1.0,
            Support::List(n) => {
                let cand = &scratch.cand[..n];
                let z = chunked_sum(cand.iter().map(|c| (c.id as usize, c.w)));
                for c in cand {
                    out[c.id as usize] = f64::from(c.w) / z;
                }
            }
            Support::Dense => {
                let w = &scratch.weights[..row.len()];
                let z = dense_sum(w);
                for (o, &wi) in out.iter_mut().zip(w) {
                    // `+ 0.0`: a probability input of -0.0 gives 0, not -0.
                    *o = f64::from(wi) / z + 0.0;
                }
            }
        }
        Ok(out)
    })
}

/// A fresh seed from the operating system's entropy source, for requests that gave none.
/// An engine calls this once per request and keeps the seed for every step.
///
/// # Errors
/// [`SampleError::SeedUnavailable`] when the OS gives no entropy.
pub fn os_seed() -> Result<u64, SampleError> {
    getrandom::u64().map_err(|e| SampleError::SeedUnavailable(e.to_string()))
}

/// A candidate token: its (penalised, pre-temperature) logit, id and weight `exp((l-max)/T)`.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Cand {
    pub(crate) logit: f32,
    pub(crate) id: u32,
    pub(crate) w: f32,
}

/// The order of filtering: better = larger logit, then lower id. Total and strict (ids differ).
#[inline]
pub(crate) fn better(a: &Cand, b: &Cand) -> Ordering {
    // `+ 0.0` turns -0.0 into +0.0: the two zeros are one value and tie (spec step 9).
    (b.logit + 0.0)
        .total_cmp(&(a.logit + 0.0))
        .then(a.id.cmp(&b.id))
}

/// A u64 whose ascending order is [`better`]'s: the logit's total-order bits, inverted, above
/// the id. Cheaper to compare than two fields.
#[inline(always)]
pub(crate) fn rank_key(c: &Cand) -> u64 {
    rank_key_of(c.logit, c.id)
}

/// [`rank_key`] of a logit and an id.
#[inline(always)]
fn rank_key_of(logit: f32, id: u32) -> u64 {
    // -0.0 and +0.0 tie (the lower id wins), so both get +0.0's key.
    let b = (logit + 0.0).to_bits();
    let ascending = if b & 0x8000_0000 != 0 {
        !b
    } else {
        b | 0x8000_0000
    };
    (u64::from(!ascending) << 32) | u64::from(id)
}

/// The logit of a [`rank_key`].
#[inline(always)]
fn key_logit(key: u64) -> f32 {
    let ascending = !((key >> 32) as u32);
    let b = if ascending & 0x8000_0000 != 0 {
        ascending & 0x7fff_ffff
    } else {
        !ascending
    };
    f32::from_bits(b)
}

thread_local! {
    /// A 16-bit row widened to f32 (kept apart from the sampler's scratch, which the row then
    /// uses).
    static WIDENED: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
}

/// Runs `f` on `row` widened to f32 in a per-thread buffer.
pub(crate) fn with_widened<T: LogitValue, R>(row: &[T], f: impl FnOnce(&[f32]) -> R) -> R {
    WIDENED.with(|buf| match buf.try_borrow_mut() {
        Ok(mut buf) => {
            buf.clear();
            buf.extend(row.iter().map(|v| v.to_f32()));
            f(&buf)
        }
        Err(_) => f(&row.iter().map(|v| v.to_f32()).collect::<Vec<f32>>()),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rank_keys_order_like_better_and_give_the_logit_back() {
        let values = [
            f32::MAX,
            3.5,
            1.0,
            1e-30,
            0.0,
            -0.0,
            -1e-30,
            -2.25,
            -f32::MAX,
            f32::INFINITY,
        ];
        let mut cands = Vec::new();
        for (i, &v) in values.iter().enumerate() {
            for id in [0u32, 7, u32::MAX - i as u32] {
                cands.push(Cand {
                    logit: v,
                    id,
                    w: 0.0,
                });
            }
        }
        for a in &cands {
            let k = rank_key(a);
            // -0.0 comes back as +0.0: the same value, and the key's tie rule.
            assert_eq!(key_logit(k).to_bits(), (a.logit + 0.0).to_bits());
            assert_eq!(k as u32, a.id);
            for b in &cands {
                assert_eq!(rank_key(a).cmp(&rank_key(b)), better(a, b), "{a:?} {b:?}");
            }
        }
    }
}
