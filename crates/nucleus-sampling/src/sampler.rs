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

use std::cell::{Cell, RefCell};
use std::cmp::Ordering;

use rayon::prelude::*;

use crate::error::{BitmaskError, SampleError, ShapeError};
use crate::kernels;
use crate::params::{LogprobsKind, SamplingParams, LOGIT_BIAS_LIMIT};
use crate::philox;
use crate::view::{InputKind, LogitValue, LogitsView};

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
        }
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

/// Processed log-probabilities: the sampled tokens' (already known) and the top `top` of the
/// final distribution.
fn processed_logprobs(
    prepared: &Prepared,
    vocab: usize,
    scratch: &Scratch,
    output: &SampleOutput,
    top: usize,
) -> Logprobs {
    let best: Vec<TokenLogprob> = match prepared.support {
        Support::Greedy(token) => vec![TokenLogprob {
            token_id: token,
            logprob: 0.0,
        }],
        Support::List(n) => {
            let cand = &scratch.cand[..n];
            let z = chunked_sum(cand.iter().map(|c| (c.id as usize, c.w)));
            let mut best: Vec<Cand> = cand.iter().filter(|c| c.w > 0.0).copied().collect();
            best.sort_unstable_by(|a, b| (b.w + 0.0).total_cmp(&(a.w + 0.0)).then(a.id.cmp(&b.id)));
            best.truncate(top);
            best.iter()
                .map(|c| TokenLogprob {
                    token_id: c.id,
                    logprob: (f64::from(c.w) / z).ln(),
                })
                .collect()
        }
        Support::Dense => dense_top_logprobs(&scratch.weights[..vocab], top),
    };
    processed_logprobs_from(output, best, top)
}

/// The `top` most likely tokens of dense weights `w` (zero for removed tokens), as natural-log
/// probabilities `ln(w_i / sum w)`, most likely first, ties toward the lower id.
pub(crate) fn dense_top_logprobs(w: &[f32], top: usize) -> Vec<TokenLogprob> {
    let z = chunked_sum(w.iter().copied().enumerate());
    top_values(w, 0.0, top)
        .into_iter()
        .map(|(id, wi)| TokenLogprob {
            token_id: id,
            logprob: (f64::from(wi) / z).ln(),
        })
        .collect()
}

/// Processed [`Logprobs`]: the sampled tokens' (from `output`) and `best`, cut or padded with
/// `-inf` entries to `top`.
pub(crate) fn processed_logprobs_from(
    output: &SampleOutput,
    mut best: Vec<TokenLogprob>,
    top: usize,
) -> Logprobs {
    let sampled = std::iter::once(output.logprob)
        .chain(output.extra_samples.iter().map(|s| s.logprob))
        .collect();
    best.truncate(top);
    fill_impossible(&mut best, top);
    Logprobs {
        kind: LogprobsKind::Processed,
        sampled,
        top: best,
    }
}

/// Raw log-probabilities (spec step 2): `log_softmax` of the row as given, in f64; for
/// probability input `ln(p_i / sum p)`.
pub(crate) fn raw_logprobs(
    row: &[f32],
    kind: InputKind,
    output: &SampleOutput,
    top: usize,
) -> Logprobs {
    let floor = match kind {
        InputKind::Logits => f32::NEG_INFINITY,
        InputKind::Probs => 0.0,
    };
    // Logits: `(l - max) - ln(sum exp(l - max))`, the difference of two f32 exact in f64, so
    // the result keeps its precision however large the logits.
    let max = match kind {
        InputKind::Logits => kernels::max_bad(row).0,
        InputKind::Probs => 0.0,
    };
    let raw = |v: f32, norm: f64| -> f64 {
        match kind {
            InputKind::Logits => (f64::from(v) - f64::from(max)) - norm,
            InputKind::Probs => (f64::from(v) / norm).ln(),
        }
    };
    let norm = match kind {
        // Every logit -inf: every raw logprob is -inf.
        InputKind::Logits if max == f32::NEG_INFINITY => f64::INFINITY,
        InputKind::Logits => {
            chunked_sum_f64(row.iter().map(|&l| (f64::from(l) - f64::from(max)).exp())).ln()
        }
        InputKind::Probs => chunked_sum_f64(row.iter().map(|&p| f64::from(p))),
    };
    let sampled = output
        .tokens()
        .map(|t| raw(row[t as usize], norm))
        .collect();
    let mut best: Vec<TokenLogprob> = top_values(row, floor, top)
        .into_iter()
        .map(|(id, v)| TokenLogprob {
            token_id: id,
            logprob: raw(v, norm),
        })
        .collect();
    fill_impossible(&mut best, top);
    Logprobs {
        kind: LogprobsKind::Raw,
        sampled,
        top: best,
    }
}

/// The `n` largest values above `floor`, largest first, ties toward the lower id.
pub(crate) fn top_values(values: &[f32], floor: f32, n: usize) -> Vec<(u32, f32)> {
    if n == 0 {
        return Vec::new();
    }
    let mut cand = Vec::new();
    top_k_candidates(values, floor, n, &mut cand);
    cand.sort_unstable_by(better);
    cand.iter().map(|c| (c.id, c.logit)).collect()
}

/// Pads a top list to `n` entries with `-inf` entries for the lowest ids not in it.
pub(crate) fn fill_impossible(best: &mut Vec<TokenLogprob>, n: usize) {
    let mut id = 0u32;
    while best.len() < n {
        if !best.iter().any(|t| t.token_id == id) {
            best.push(TokenLogprob {
                token_id: id,
                logprob: f64::NEG_INFINITY,
            });
        }
        id += 1;
    }
}

/// [`chunked_sum`] over f64 terms given for ids `0, 1, 2, ...`.
fn chunked_sum_f64(items: impl Iterator<Item = f64>) -> f64 {
    let mut total = 0.0f64;
    let mut partial = 0.0f64;
    for (i, x) in items.enumerate() {
        if i % CHUNK == 0 {
            total += partial;
            partial = 0.0;
        }
        partial += x;
    }
    total + partial
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
                let z = chunked_sum(w.iter().copied().enumerate());
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
fn better(a: &Cand, b: &Cand) -> Ordering {
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

/// Per-thread buffers, reused across rows so the hot path does not allocate once warm.
#[derive(Default)]
struct Scratch {
    /// The penalised copy of the row (only when a penalty applies).
    logits: Vec<f32>,
    /// Candidates of top-k / top-p; after `prepare`, `cand[..n]` is the survivor list.
    cand: Vec<Cand>,
    /// Dense weights, zero for removed tokens (when the survivors are not a short list).
    weights: Vec<f32>,
    /// Bitset of ids already penalised (distinct ids count once).
    seen: Vec<u64>,
    /// Occurrence counts of output ids (frequency penalty); all zero between rows.
    counts: Vec<u32>,
    /// Bitset marking ids while the sparse modification list is built; all zero between rows.
    mark: Vec<u64>,
    /// Candidate logits and weights, gathered for the vectorised exp.
    cand_w: Vec<f32>,
    /// Ids that steps 3-5 may change (sparse mode), in first-seen order.
    mod_ids: Vec<u32>,
    /// Their values after steps 3-5.
    mod_vals: Vec<f32>,
    /// Id -> index in `mod_ids` (sparse mode), an open-addressing table.
    slot_table: Vec<u64>,
}

thread_local! {
    static SCRATCH: RefCell<Scratch> = RefCell::new(Scratch::default());
    /// A 16-bit row widened to f32 (kept apart from [`SCRATCH`], which the row then uses).
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

fn with_scratch<T>(f: impl FnOnce(&mut Scratch) -> T) -> T {
    SCRATCH.with(|s| match s.try_borrow_mut() {
        Ok(mut scratch) => f(&mut scratch),
        // Re-entrant use (not expected): fall back to fresh buffers rather than panic.
        Err(_) => f(&mut Scratch::default()),
    })
}

/// Where the final distribution lives after [`prepare`].
enum Support {
    /// One token with probability 1.
    Greedy(u32),
    /// `scratch.cand[..n]`, sorted by id, with weights.
    List(usize),
    /// `scratch.weights[..vocab]`, zero for removed tokens.
    Dense,
}

struct Prepared {
    support: Support,
}

/// Steps 1-10: checks, constraints, bias, penalties, greedy or temperature, min-p, top-k,
/// top-p. Leaves the survivors and their weights in `scratch`.
///
/// Passes over the row (logit input), by case:
/// - greedy, top-k (with or without min-p / top-p): one vectorised block-max pass (which also
///   finds NaN / +inf), then a scan of only the blocks whose maximum can still enter the best
///   `k`; steps 3-5, when they apply, touch a few ids, which the scan takes into account by
///   keeping `k + m` raw candidates (`m` modified ids) and replacing the modified ones;
/// - min-p alone: the same first pass, then only blocks that reach the min-p cut;
/// - top-p without top-k: the first pass, one vectorised exp pass (weights, their sum, and the
///   weight below a few logit levels, which bounds where the top-p boundary can be), then only
///   blocks above the chosen level;
/// - plain temperature sampling: the first pass and the exp pass.
fn prepare(
    row: &[f32],
    kind: InputKind,
    request: &SampleRequest<'_>,
    scratch: &mut Scratch,
    split: bool,
) -> Result<Prepared, SampleError> {
    // The copy of the row lives outside `scratch` while the rest of it is written.
    let mut copy = std::mem::take(&mut scratch.logits);
    let split = split && row.len() >= SPLIT_MIN && rayon::current_num_threads() > 1;
    let prepared = prepare_with(row, kind, request, &mut copy, scratch, split);
    scratch.logits = copy;
    prepared
}

fn prepare_with(
    row: &[f32],
    kind: InputKind,
    request: &SampleRequest<'_>,
    copy: &mut Vec<f32>,
    scratch: &mut Scratch,
    split: bool,
) -> Result<Prepared, SampleError> {
    let params = request.params;
    params.validate()?;
    let probs = kind == InputKind::Probs;
    if probs {
        check_probs_params(params)?;
    }
    // The value that masks a token: -inf for logits, 0 for probabilities.
    let floor = if probs { 0.0 } else { f32::NEG_INFINITY };
    let vocab = row.len();
    if let Some(mask) = request.token_bitmask {
        let needed = crate::bitmask::bitmask_words(vocab);
        if mask.len() < needed {
            return Err(BitmaskError::RowTooShort {
                words: mask.len(),
                needed,
                row_len: vocab,
            }
            .into());
        }
    }
    // Token ids of the context and the parameters must be below `vocab`: a vectorised max
    // per list, and the first offender only when one is out of range.
    let context = [
        ("prompt_ids", request.prompt_ids),
        ("output_ids", request.output_ids),
        ("stop_token_ids", request.stop_token_ids),
    ];
    for (field, ids) in context {
        if ids
            .iter()
            .copied()
            .max()
            .is_some_and(|m| m as usize >= vocab)
        {
            let bad = ids
                .iter()
                .copied()
                .find(|&id| id as usize >= vocab)
                .unwrap_or(0);
            return Err(SampleError::TokenIdOutOfRange {
                field,
                token_id: bad,
                vocab_size: vocab,
            });
        }
    }
    if let Some((field, bad)) = params.named_ids().find(|&(_, id)| id as usize >= vocab) {
        return Err(SampleError::TokenIdOutOfRange {
            field,
            token_id: bad,
            vocab_size: vocab,
        });
    }
    // Step 1 for probabilities: NaN, infinite or negative values.
    if probs {
        if let Some(i) = row.iter().position(|&v| !(v.is_finite() && v >= 0.0)) {
            return Err(SampleError::InvalidProbability {
                token_id: i as u32,
                value: row[i],
            });
        }
    }

    let greedy = params.is_greedy();
    let top_k = usize::try_from(params.top_k).unwrap_or(0);
    let k_on = !greedy && top_k > 0 && top_k < vocab;
    let p_on = !greedy && params.top_p < 1.0;
    // How many of the best tokens the first scan keeps: the k of top-k, else the maximum.
    let keep = if k_on { top_k } else { 1 };

    // Steps 3-5. Few modified ids and a short candidate list: keep the raw row and a sparse
    // list of modified values. Otherwise a per-thread copy of the row, modified in place.
    let modifies = modifies_logits(request);
    let sparse = modifies
        && params.allowed_token_ids.is_none()
        && request.token_bitmask.is_none()
        && (greedy || k_on)
        && list_modified_ids(vocab, keep, request, scratch);
    let logits: &[f32] = if modifies && !sparse {
        // Step 1 on the caller's row, then the copy.
        if kernels::max_bad(row).1 {
            return Err(non_finite(row));
        }
        apply_constraints_bias_penalties(row, floor, request, copy, scratch)?;
        &copy[..vocab]
    } else {
        row
    };

    // The best `keep` candidates (plus the modified ids in sparse mode), in one pass that also
    // finds NaN / +inf (step 1 for logits; the copy's source row was checked above). One
    // candidate: the maximum, by a vectorised max over blocks.
    // Top-p alone on logits: the maximum and the normaliser in one online pass.
    let online = !greedy && !k_on && p_on && params.min_p == 0.0 && !probs;
    let mut online_z = None;
    // Min-p without top-k on logits: the maximum and every token within the min-p window of
    // the running maximum, in one pass.
    let window = !greedy && !k_on && params.min_p > 0.0 && !probs;
    let bad = if window {
        let level = params.min_p.ln();
        let t64 = params.temperature;
        scan_window(
            logits,
            floor,
            &|m| logit_cut(m, level, t64),
            &mut scratch.cand,
            split,
        )
    } else if online {
        let r = row_max_sum_exp(logits, params.temperature as f32, split);
        scratch.cand.clear();
        if r.max > floor {
            // The maximum's id is not needed: top-p collects every candidate again.
            scratch.cand.push(Cand {
                logit: r.max,
                id: 0,
                w: 0.0,
            });
            if r.max <= 1e30 {
                online_z = Some(r.sum);
            }
        }
        r.bad
    } else if sparse {
        // The best `keep` unmodified ids (the modified ones, marked, are skipped), then the
        // modified ones with their new values (steps 3-5, after the row check of step 1):
        // the best `keep` of both is exact.
        let bad = scan_top(logits, floor, keep, &scratch.mark, &mut scratch.cand, split);
        for &id in &scratch.mod_ids {
            scratch.mark[id as usize / 64] = 0;
        }
        if bad {
            return Err(non_finite(row));
        }
        apply_sparse_modifications(row, floor, request, scratch)?;
        merge_modifications(floor, keep, scratch);
        false
    } else {
        scan_top(logits, floor, keep, &[], &mut scratch.cand, split)
    };
    if bad && !probs && logits.as_ptr() == row.as_ptr() {
        return Err(non_finite(row));
    }
    let Some(best) = scratch.cand.iter().copied().min_by(better) else {
        return Err(SampleError::NoCandidates);
    };
    let max = best.logit;

    // Step 6: greedy.
    if greedy {
        return Ok(Prepared {
            support: Support::Greedy(best.id),
        });
    }

    // Step 7: temperature, `(l - max) / T` in f32; probabilities are their own weights.
    let t = params.temperature as f32;
    let t64 = params.temperature;
    let weight = |l: f32| {
        if probs {
            l
        } else {
            kernels::exp_w(scaled(l, max, t, t64))
        }
    };

    // Step 8: min_p keeps tokens with `p >= min_p * p_max`, decided in f64 on the row's
    // values: for logits `(l - max) / T >= ln(min_p)`, for probabilities `p >= min_p * max`.
    // Monotone in the value, so the kept set is a prefix of the (value desc, id asc) order,
    // like those of top-k and top-p.
    let min_p_on = params.min_p > 0.0;
    let ln_min_p = params.min_p.ln();
    let min_p_abs = params.min_p * f64::from(max);
    let passes_min_p = |l: f32| {
        !min_p_on
            || if probs {
                f64::from(l) >= min_p_abs
            } else {
                f64::from(scaled(l, max, t, t64)) >= ln_min_p
            }
    };

    let cand = &mut scratch.cand;
    if k_on {
        // Step 9: `cand` holds the top k. top-k and min_p keep prefixes of one order: their
        // intersection is the shorter one. Sorted by rank, so that what follows (top-p's f64
        // sums) sees one order however the scan ran.
        cand.sort_unstable_by_key(rank_key);
        if min_p_on {
            cand.retain(|c| passes_min_p(c.logit));
        }
        set_weights(cand, &mut scratch.cand_w, max, t, probs, &weight);
    } else if min_p_on {
        if !window {
            // A cut at or below the min-p threshold (the window pass did this for logits).
            cand.clear();
            let cut = if probs {
                (min_p_abs as f32).min(max)
            } else {
                logit_cut(max, ln_min_p, t64)
            };
            collect(logits, floor, cut, cand, split);
        }
        // The exact test.
        cand.retain(|c| passes_min_p(c.logit));
        set_weights(cand, &mut scratch.cand_w, max, t, probs, &weight);
    } else if !p_on {
        // Plain sampling at temperature T: every token.
        let w = dense_weights(&mut scratch.weights, vocab);
        if probs {
            w.copy_from_slice(logits);
        } else {
            if row_exp_pass(logits, max, t, w, split) {
                for (wi, &l) in w.iter_mut().zip(logits) {
                    *wi = weight(l);
                }
            }
        }
        return Ok(Prepared {
            support: Support::Dense,
        });
    } else {
        // Top-p alone. Weights of every token and their sum `z`. The tokens ranked at or
        // below the boundary token weigh more than `(1 - p) z`; if the boundary's weight were
        // below `eps = (1 - p) z / vocab`, those tokens would all weigh less than `eps` and
        // so less than `(1 - p) z` together. So only tokens with weight `>= eps` (a cut
        // slightly below, in logit units) are candidates.
        let mut level = f32::NEG_INFINITY;
        let mut weights_ready = false;
        let z = match online_z {
            Some(z) => {
                let eps = (1.0 - params.top_p) * z / vocab as f64;
                if eps > 0.0 {
                    // The exps are within 1e-6 relative of exp: a margin of 1e-3 in log units.
                    level = (eps.ln() - 1e-3) as f32;
                }
                z
            }
            None => {
                // Probabilities, or logits beyond ±1e30: every weight, exactly.
                weights_ready = true;
                let w = dense_weights(&mut scratch.weights, vocab);
                for (wi, &l) in w.iter_mut().zip(logits) {
                    *wi = weight(l);
                }
                chunked_sum(w.iter().copied().enumerate())
            }
        };
        // The best token alone holds at least `p z`: it is the whole shortest prefix (the
        // lowest id holding the maximum, by the (logit desc, id asc) order). Common when the
        // model is confident; it saves the candidate pass. Its weight is computed as
        // `set_weights` would, so the decision is the one `top_p_prefix` would take.
        let w_max = weight(max);
        if !weights_ready && f64::from(w_max) >= params.top_p * z {
            if let Some(id) = first_at_least(logits, max) {
                cand.clear();
                cand.push(Cand {
                    logit: logits[id],
                    id: id as u32,
                    w: w_max,
                });
                return finish(logits, 1, scratch, false, weight);
            }
        }
        cand.clear();
        let cut = if level == f32::NEG_INFINITY {
            f32::NEG_INFINITY
        } else {
            logit_cut(max, f64::from(level), t64)
        };
        collect(logits, floor, cut, cand, split);
        set_weights(cand, &mut scratch.cand_w, max, t, probs, &weight);
        let kept = top_p_prefix(cand, params.top_p * z);
        return finish(logits, kept, scratch, weights_ready, weight);
    }

    // Step 10: top-p over the candidates, renormalised among them.
    let kept = if p_on {
        let z: f64 = cand.iter().map(|c| f64::from(c.w)).sum();
        top_p_prefix(cand, params.top_p * z)
    } else {
        cand.len()
    };
    finish(logits, kept, scratch, false, weight)
}

/// The survivors are `cand[..kept]`, a prefix of the (logit desc, id asc) order: a short list
/// is sorted by id; a long one becomes dense weights (every finite value ranked at or above
/// the worst survivor), taken from `scratch.weights` when `weights_ready` (it holds every
/// token's weight), else computed with `weight`.
fn finish(
    logits: &[f32],
    kept: usize,
    scratch: &mut Scratch,
    weights_ready: bool,
    weight: impl Fn(f32) -> f32,
) -> Result<Prepared, SampleError> {
    let vocab = logits.len();
    let cand = &mut scratch.cand;
    if kept == 0 {
        // Not reachable (the maximum always survives); an error rather than a panic.
        return Err(SampleError::NoCandidates);
    }
    if kept * LIST_FRACTION <= vocab {
        cand.truncate(kept);
        cand.sort_unstable_by_key(|c| c.id);
        return Ok(Prepared {
            support: Support::List(kept),
        });
    }
    let Some(worst) = cand[..kept].iter().copied().max_by(better) else {
        return Err(SampleError::NoCandidates);
    };
    let w = dense_weights(&mut scratch.weights, vocab);
    for (i, (wi, &l)) in w.iter_mut().zip(logits).enumerate() {
        let keep = l > worst.logit || (l == worst.logit && i as u32 <= worst.id);
        *wi = if !keep {
            0.0
        } else if weights_ready {
            *wi
        } else {
            weight(l)
        };
    }
    Ok(Prepared {
        support: Support::Dense,
    })
}

/// Sets each candidate's weight to `weight(logit)`: for logits by the vectorised
/// [`kernels::exp_pass`] over the gathered logits (the same formula, the same bits), unless
/// `l - max` may overflow; probabilities are their own weights.
fn set_weights(
    cand: &mut [Cand],
    buf: &mut Vec<f32>,
    max: f32,
    t: f32,
    probs: bool,
    weight: &impl Fn(f32) -> f32,
) {
    if probs || cand.len() < 16 || max > 1e30 {
        for c in cand.iter_mut() {
            c.w = weight(c.logit);
        }
        return;
    }
    buf.clear();
    buf.extend(cand.iter().map(|c| c.logit));
    buf.resize(2 * cand.len(), 0.0);
    let (logits, w) = buf.split_at_mut(cand.len());
    kernels::exp_pass(logits, max, t, w);
    for (c, &wi) in cand.iter_mut().zip(w.iter()) {
        c.w = wi;
    }
}

/// [`kernels::max_sum_exp`] over the row, chunk by chunk across the pool when `split`
/// (folded in chunk order: the same bits).
fn row_max_sum_exp(logits: &[f32], t: f32, split: bool) -> kernels::MaxSumExp {
    if split {
        let parts: Vec<Vec<kernels::MaxSumExp>> = logits
            .par_chunks(piece(logits.len()))
            .map(|part| {
                part.chunks(CHUNK)
                    .map(|chunk| kernels::max_sum_exp(chunk, t))
                    .collect()
            })
            .collect();
        kernels::max_sum_exp_fold(parts.into_iter().flatten(), t)
    } else {
        kernels::max_sum_exp(logits, t)
    }
}

/// [`kernels::exp_pass`] over the row (chunks across the pool when `split`); returns whether
/// the caller must redo it exactly (`l - max` may have overflowed).
fn row_exp_pass(logits: &[f32], max: f32, t: f32, out: &mut [f32], split: bool) -> bool {
    if split {
        logits
            .par_chunks(piece(logits.len()))
            .zip(out.par_chunks_mut(piece(logits.len())))
            .map(|(part, o)| kernels::exp_pass(part, max, t, o).overflow)
            .reduce(|| false, |a, b| a | b)
    } else {
        kernels::exp_pass(logits, max, t, out).overflow
    }
}

/// The error for a row holding NaN or +inf: the lowest such id.
pub(crate) fn non_finite(row: &[f32]) -> SampleError {
    let i = row
        .iter()
        .position(|&v| v.is_nan() || v == f32::INFINITY)
        .unwrap_or(0);
    SampleError::NonFiniteLogits {
        token_id: i as u32,
        value: row[i],
    }
}

/// The exactly-`keep` best tokens (value desc, id asc) among the values above `floor` whose
/// ids are not set in the bitset `exclude` (empty: none excluded), into `out` (unordered), in
/// one vectorised pass that also reports whether any value is NaN or +inf. `keep >= 1`.
pub(crate) fn scan_top(
    logits: &[f32],
    floor: f32,
    keep: usize,
    exclude: &[u64],
    out: &mut Vec<Cand>,
    split: bool,
) -> bool {
    if split {
        // The first chunk alone; its `keep`-th best value is a lower bound of the row's (an
        // element of a later chunk, so of a higher id, must beat it strictly), which lets every
        // other chunk, in parallel, skip nearly everything. Then the best `keep` of all the
        // chunks' candidates: a set that does not depend on the split (a buffer per chunk:
        // the split path allocates).
        let first = logits.len().min(CHUNK);
        out.clear();
        let mut bad = scan_top(&logits[..first], floor, keep, exclude, out, false);
        let start = match out.iter().max_by_key(|c| rank_key(c)) {
            Some(worst) if out.len() == keep => worst.logit,
            _ => floor,
        };
        let size = piece(logits.len() - first);
        let parts: Vec<(Vec<Cand>, bool)> = logits[first..]
            .par_chunks(size)
            .enumerate()
            .map(|(c, part)| {
                let offset = first + c * size;
                let exclude = if exclude.is_empty() {
                    exclude
                } else {
                    &exclude[offset / 64..]
                };
                let mut v = Vec::new();
                let bad = scan_top(part, start, keep, exclude, &mut v, false);
                for cand in &mut v {
                    cand.id += offset as u32;
                }
                (v, bad)
            })
            .collect();
        for (v, b) in parts {
            out.extend_from_slice(&v);
            bad |= b;
        }
        if out.len() > keep {
            compact(out, keep);
        }
        return bad;
    }
    match kernels::isa() {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `isa()` reports AVX-512F only when the CPU has it.
        kernels::Isa::Avx512 => unsafe { x86::scan_top_avx512(logits, floor, keep, exclude, out) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `isa()` reports AVX2 only when the CPU has it.
        kernels::Isa::Avx2 => unsafe { x86::scan_top_avx2(logits, floor, keep, exclude, out) },
        kernels::Isa::Baseline => scan_top_body::<SSE2>(logits, floor, keep, exclude, out),
    }
}

/// Every token above `floor` whose value is at or above `cut(running maximum)`, into `out`
/// in id order, in one vectorised pass; returns whether any value is NaN or +inf. `cut` must
/// be monotone and at most its argument, so the result holds every token at or above
/// `cut(max)` of the row's maximum (and the maximum itself), plus perhaps some below.
fn scan_window(
    logits: &[f32],
    floor: f32,
    cut: &(impl Fn(f32) -> f32 + Sync),
    out: &mut Vec<Cand>,
    split: bool,
) -> bool {
    if split {
        let size = piece(logits.len());
        let parts: Vec<(Vec<Cand>, bool)> = logits
            .par_chunks(size)
            .enumerate()
            .map(|(c, part)| {
                let mut v = Vec::new();
                let bad = scan_window(part, floor, cut, &mut v, false);
                for cand in &mut v {
                    cand.id += (c * size) as u32;
                }
                (v, bad)
            })
            .collect();
        out.clear();
        let mut bad = false;
        for (v, b) in parts {
            out.extend_from_slice(&v);
            bad |= b;
        }
        return bad;
    }
    let mut max = floor;
    let mut threshold = floor;
    let mut pruned_at = 0usize;
    out.clear();
    let mut visit = |i: usize, l: f32, threshold: &mut f32| {
        if l <= floor {
            return;
        }
        if l > max {
            max = l;
            *threshold = cut(max).max(floor);
            // Drop what fell out of the window once the buffer has doubled.
            if out.len() >= 2 * pruned_at + 64 {
                let t = *threshold;
                out.retain(|c| c.logit >= t);
                pruned_at = out.len();
            }
        }
        out.push(Cand {
            logit: l,
            id: i as u32,
            w: 0.0,
        });
    };
    match kernels::isa() {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `isa()` reports AVX-512F only when the CPU has it.
        kernels::Isa::Avx512 => unsafe { x86::window_avx512(logits, &mut threshold, &mut visit) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `isa()` reports AVX2 only when the CPU has it.
        kernels::Isa::Avx2 => unsafe { x86::window_avx2(logits, &mut threshold, &mut visit) },
        kernels::Isa::Baseline => scan_runs::<SSE2, true>(logits, &mut threshold, visit),
    }
}

/// Appends to `out` every token above `floor` whose value is `>= cut`, in id order, in one
/// vectorised pass of compares.
pub(crate) fn collect(logits: &[f32], floor: f32, cut: f32, out: &mut Vec<Cand>, split: bool) {
    if split {
        let size = piece(logits.len());
        let parts: Vec<Vec<Cand>> = logits
            .par_chunks(size)
            .enumerate()
            .map(|(c, part)| {
                let mut v = Vec::new();
                collect(part, floor, cut, &mut v, false);
                for cand in &mut v {
                    cand.id += (c * size) as u32;
                }
                v
            })
            .collect();
        for v in parts {
            out.extend_from_slice(&v);
        }
        return;
    }
    match kernels::isa() {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `isa()` reports AVX-512F only when the CPU has it.
        kernels::Isa::Avx512 => unsafe { x86::collect_avx512(logits, floor, cut, out) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `isa()` reports AVX2 only when the CPU has it.
        kernels::Isa::Avx2 => unsafe { x86::collect_avx2(logits, floor, cut, out) },
        kernels::Isa::Baseline => collect_body::<SSE2>(logits, floor, cut, out),
    }
}

/// The lowest index whose value is `>= t`, in a vectorised pass that stops there. For rows
/// already checked for NaN (a NaN would count as a hit).
pub(crate) fn first_at_least(values: &[f32], t: f32) -> Option<usize> {
    match kernels::isa() {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `isa()` reports AVX-512F only when the CPU has it.
        kernels::Isa::Avx512 => unsafe { x86::first_at_least_avx512(values, t) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `isa()` reports AVX2 only when the CPU has it.
        kernels::Isa::Avx2 => unsafe { x86::first_at_least_avx2(values, t) },
        kernels::Isa::Baseline => first_at_least_body::<SSE2>(values, t),
    }
}

#[inline(always)]
fn first_at_least_body<const ISA: u8>(values: &[f32], t: f32) -> Option<usize> {
    let whole = values.len() / RUN * RUN;
    for (r, run) in values[..whole].chunks_exact(RUN).enumerate() {
        let mask = run_mask::<ISA, true>(run, t);
        if mask != 0 {
            return Some(r * RUN + mask.trailing_zeros() as usize);
        }
    }
    values[whole..]
        .iter()
        .position(|&x| x >= t || x.is_nan())
        .map(|j| whole + j)
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::Cand;

    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn first_at_least_avx512(values: &[f32], t: f32) -> Option<usize> {
        super::first_at_least_body::<{ super::AVX512 }>(values, t)
    }

    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn first_at_least_avx2(values: &[f32], t: f32) -> Option<usize> {
        super::first_at_least_body::<{ super::AVX2 }>(values, t)
    }

    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn scan_top_avx512(
        logits: &[f32],
        floor: f32,
        keep: usize,
        exclude: &[u64],
        out: &mut Vec<Cand>,
    ) -> bool {
        super::scan_top_body::<{ super::AVX512 }>(logits, floor, keep, exclude, out)
    }

    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn scan_top_avx2(
        logits: &[f32],
        floor: f32,
        keep: usize,
        exclude: &[u64],
        out: &mut Vec<Cand>,
    ) -> bool {
        super::scan_top_body::<{ super::AVX2 }>(logits, floor, keep, exclude, out)
    }

    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn window_avx512(
        logits: &[f32],
        threshold: &mut f32,
        visit: &mut impl FnMut(usize, f32, &mut f32),
    ) -> bool {
        super::scan_runs::<{ super::AVX512 }, true>(logits, threshold, visit)
    }

    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn window_avx2(
        logits: &[f32],
        threshold: &mut f32,
        visit: &mut impl FnMut(usize, f32, &mut f32),
    ) -> bool {
        super::scan_runs::<{ super::AVX2 }, true>(logits, threshold, visit)
    }

    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn collect_avx512(logits: &[f32], floor: f32, cut: f32, out: &mut Vec<Cand>) {
        super::collect_body::<{ super::AVX512 }>(logits, floor, cut, out)
    }

    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn collect_avx2(logits: &[f32], floor: f32, cut: f32, out: &mut Vec<Cand>) {
        super::collect_body::<{ super::AVX2 }>(logits, floor, cut, out)
    }
}

/// Values per run of the vectorised compares: one bit mask per run.
const RUN: usize = 64;

/// Instruction-set levels of [`run_masks`]: SSE2 (part of x86-64), AVX2, AVX-512F.
const SSE2: u8 = 0;
const AVX2: u8 = 1;
const AVX512: u8 = 2;

/// The bit mask of one run: bit `j` is set when `run[j] > t` (`>= t` when `INCLUSIVE`) or
/// `run[j]` is NaN (unordered compares: one instruction per vector). `ISA` picks the
/// instructions; a level above SSE2 is only instantiated inside functions compiled with that
/// level enabled (the target_feature wrappers of [`x86`]).
#[inline(always)]
fn run_mask<const ISA: u8, const INCLUSIVE: bool>(run: &[f32], t: f32) -> u64 {
    debug_assert_eq!(run.len(), RUN);
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::*;
        // SAFETY: `run` holds RUN = 64 values (unaligned loads); levels above SSE2 run only
        // where the caller was compiled with them (see above); SSE2 is part of x86-64.
        unsafe {
            let p = run.as_ptr();
            let mut mask = 0u64;
            if ISA == AVX512 {
                let tv = _mm512_set1_ps(t);
                let cmp = |q: usize| {
                    let x = _mm512_loadu_ps(p.add(16 * q));
                    if INCLUSIVE {
                        _mm512_cmp_ps_mask::<_CMP_NLT_UQ>(x, tv)
                    } else {
                        _mm512_cmp_ps_mask::<_CMP_NLE_UQ>(x, tv)
                    }
                };
                let (m0, m1, m2, m3) = (cmp(0), cmp(1), cmp(2), cmp(3));
                // Most runs pass nothing: one test of the four masks OR-ed, before building
                // the 64-bit mask.
                if (m0 | m1 | m2 | m3) != 0 {
                    mask = u64::from(m0)
                        | (u64::from(m1) << 16)
                        | (u64::from(m2) << 32)
                        | (u64::from(m3) << 48);
                }
            } else if ISA == AVX2 {
                let tv = _mm256_set1_ps(t);
                for q in 0..RUN / 8 {
                    let x = _mm256_loadu_ps(p.add(8 * q));
                    let m = if INCLUSIVE {
                        _mm256_cmp_ps::<_CMP_NLT_UQ>(x, tv)
                    } else {
                        _mm256_cmp_ps::<_CMP_NLE_UQ>(x, tv)
                    };
                    mask |= u64::from(_mm256_movemask_ps(m) as u32) << (8 * q);
                }
            } else {
                let tv = _mm_set1_ps(t);
                for q in 0..RUN / 4 {
                    let x = _mm_loadu_ps(p.add(4 * q));
                    let m = if INCLUSIVE {
                        _mm_cmpnlt_ps(x, tv)
                    } else {
                        _mm_cmpnle_ps(x, tv)
                    };
                    mask |= u64::from(_mm_movemask_ps(m) as u32) << (4 * q);
                }
            }
            mask
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let mut mask = 0u64;
        for (j, &x) in run.iter().enumerate() {
            let p = if INCLUSIVE { !(x < t) } else { !(x <= t) };
            mask |= u64::from(p) << j;
        }
        mask
    }
}

/// Calls `visit(i, values[i], threshold)` for the values above the threshold (at or above
/// when `INCLUSIVE`), in index order, reading the threshold again after each visit; returns
/// whether any value is NaN or +inf (those are never visited). Runs whose mask is empty cost
/// one vector compare each: NaN sets a mask bit, and +inf beats every threshold the callers
/// use (finite or -inf), so both are seen.
#[inline(always)]
fn scan_runs<const ISA: u8, const INCLUSIVE: bool>(
    values: &[f32],
    threshold: &mut f32,
    mut visit: impl FnMut(usize, f32, &mut f32),
) -> bool {
    let pass = |x: f32, t: f32| if INCLUSIVE { x >= t } else { x > t };
    let mut bad = false;
    let whole = values.len() / RUN * RUN;
    for (r, run) in values[..whole].chunks_exact(RUN).enumerate() {
        let mut mask = run_mask::<ISA, INCLUSIVE>(run, *threshold);
        while mask != 0 {
            let j = mask.trailing_zeros() as usize;
            mask &= mask - 1;
            let x = run[j];
            if kernels::is_bad(x) {
                bad = true;
            } else if pass(x, *threshold) {
                visit(r * RUN + j, x, threshold);
            }
        }
    }
    for (j, &x) in values[whole..].iter().enumerate() {
        if kernels::is_bad(x) {
            bad = true;
        } else if pass(x, *threshold) {
            visit(whole + j, x, threshold);
        }
    }
    bad
}

/// [`scan_top`]: a buffer of candidates above a rising threshold. An element enters only if
/// it beats the current `keep`-th best (strictly: an equal element has a higher id, so it ranks
/// lower); the buffer is cut back to `keep` by a linear-time selection whenever it holds
/// `2 keep` elements, raising the threshold. Amortised O(1) per element.
#[inline(always)]
fn scan_top_body<const ISA: u8>(
    logits: &[f32],
    floor: f32,
    keep: usize,
    exclude: &[u64],
    out: &mut Vec<Cand>,
) -> bool {
    out.clear();
    let cap = 2 * keep;
    let mut threshold = floor;
    // The buffer holds rank keys (u64: cheaper to select on than candidates).
    let mut keys = KEYS.with(Cell::take);
    keys.clear();
    let bad = scan_runs::<ISA, false>(logits, &mut threshold, |i, l, threshold| {
        if !exclude.is_empty() && exclude[i / 64] & (1 << (i % 64)) != 0 {
            return;
        }
        keys.push(rank_key_of(l, i as u32));
        if keys.len() >= cap {
            keys.select_nth_unstable(keep - 1);
            keys.truncate(keep);
            *threshold = key_logit(keys[keep - 1]);
        }
    });
    if keys.len() > keep {
        keys.select_nth_unstable(keep - 1);
        keys.truncate(keep);
    }
    out.extend(keys.iter().map(|&k| Cand {
        logit: key_logit(k),
        id: k as u32,
        w: 0.0,
    }));
    KEYS.with(|k| k.set(keys));
    bad
}

thread_local! {
    /// [`scan_top`]'s buffer of rank keys, reused across rows (taken out while in use, so the
    /// hot loop holds no borrow and no closure: closures do not inherit target features).
    static KEYS: Cell<Vec<u64>> = const { Cell::new(Vec::new()) };
}

#[inline(always)]
fn collect_body<const ISA: u8>(logits: &[f32], floor: f32, cut: f32, out: &mut Vec<Cand>) {
    let mut threshold = cut;
    scan_runs::<ISA, true>(logits, &mut threshold, |i, l, _| {
        if l > floor {
            out.push(Cand {
                logit: l,
                id: i as u32,
                w: 0.0,
            });
        }
    });
}

/// Keeps the best `keep` candidates, the worst of them last.
#[inline(never)]
fn compact(out: &mut Vec<Cand>, keep: usize) {
    out.select_nth_unstable_by_key(keep - 1, rank_key);
    out.truncate(keep);
}

/// A logit at or below every `l` with `(l - max) / T >= level` (`level <= 0`, in f64 with a
/// relative margin far above f32 rounding): a cut for [`collect`], followed by an exact test
/// where exactness matters.
fn logit_cut(max: f32, level: f64, t64: f64) -> f32 {
    let max64 = f64::from(max);
    let cut = max64 + level * t64 * (1.0 + 1e-5) - 1e-5 * (1.0 + max64.abs());
    if cut <= f64::from(f32::MIN) {
        f32::NEG_INFINITY
    } else {
        // Round toward -inf.
        let c = cut as f32;
        if f64::from(c) > cut {
            c.next_down()
        } else {
            c
        }
    }
}

/// Lists the ids that steps 3-5 may change in `scratch.mod_ids` (first-seen order), marks
/// them in `scratch.mark`, and returns `true`
/// when the sparse path applies: at most `vocab / LIST_FRACTION - keep` such ids. Otherwise
/// nothing stays marked and it returns `false` (a copy of the row is then cheaper). Not for
/// `allowed_token_ids`, which changes every id.
fn list_modified_ids(
    vocab: usize,
    keep: usize,
    request: &SampleRequest<'_>,
    scratch: &mut Scratch,
) -> bool {
    let params = request.params;
    let output = request.output_ids;
    let limit = (vocab / LIST_FRACTION).saturating_sub(keep);
    let ids = &mut scratch.mod_ids;
    ids.clear();
    let bad_words = params.bad_words.iter().filter_map(|w| w.last());
    let stops = request
        .stop_token_ids
        .iter()
        .filter(|_| output.len() < params.min_tokens);
    let bias = params.logit_bias.keys();
    let repeated = request
        .prompt_ids
        .iter()
        .chain(output)
        .filter(|_| params.repetition_penalty != 1.0);
    let counted = output
        .iter()
        .filter(|_| params.frequency_penalty != 0.0 || params.presence_penalty != 0.0);
    let words = vocab.div_ceil(64);
    if scratch.mark.len() < words {
        scratch.mark.resize(words, 0);
    }
    let mark = &mut scratch.mark;
    for &id in bad_words
        .chain(stops)
        .chain(bias)
        .chain(repeated)
        .chain(counted)
    {
        let (word, bit) = (id as usize / 64, 1u64 << (id % 64));
        if mark[word] & bit == 0 {
            if ids.len() == limit {
                for &id in ids.iter() {
                    mark[id as usize / 64] = 0;
                }
                ids.clear();
                return false;
            }
            mark[word] |= bit;
            ids.push(id);
        }
    }
    true
}

/// The values of `scratch.mod_ids` after steps 3-5, into `scratch.mod_vals`: computed exactly
/// as on a copy of the row ([`modify`] on the listed ids only).
///
/// # Errors
/// As [`modify`].
fn apply_sparse_modifications(
    row: &[f32],
    floor: f32,
    request: &SampleRequest<'_>,
    scratch: &mut Scratch,
) -> Result<(), SampleError> {
    scratch.mod_vals.clear();
    scratch
        .mod_vals
        .extend(scratch.mod_ids.iter().map(|&id| row[id as usize]));
    let params = request.params;
    if params.bad_words.is_empty()
        && params.logit_bias.is_empty()
        && (request.output_ids.len() >= params.min_tokens || request.stop_token_ids.is_empty())
        && params.frequency_penalty == 0.0
        && params.presence_penalty == 0.0
    {
        // Only the repetition penalty: the listed ids are exactly the distinct prompt and
        // output ids, each penalised once, as `modify` does.
        let penalty = params.repetition_penalty;
        let r = penalty as f32;
        for (&id, l) in scratch.mod_ids.iter().zip(scratch.mod_vals.iter_mut()) {
            let before = *l;
            *l = if before > 0.0 { before / r } else { before * r };
            if before.is_finite() && !l.is_finite() {
                return Err(SampleError::PenaltyOverflow {
                    token_id: id,
                    logit: before,
                    penalty,
                });
            }
        }
        return Ok(());
    }
    // A small open-addressing table id -> slot (a few KiB: stays in cache).
    let ids = &scratch.mod_ids;
    let bits = (2 * ids.len()).next_power_of_two().max(16).trailing_zeros();
    let table = &mut scratch.slot_table;
    table.clear();
    table.resize(1 << bits, u64::MAX);
    for (slot, &id) in ids.iter().enumerate() {
        let mut h = slot_hash(id, bits);
        while table[h] != u64::MAX {
            h = (h + 1) & (table.len() - 1);
        }
        table[h] = (u64::from(id) << 32) | slot as u64;
    }
    let mut slots = Sparse {
        table: &scratch.slot_table,
        bits,
        vals: &mut scratch.mod_vals,
    };
    modify(
        &mut slots,
        floor,
        request,
        row.len(),
        &mut scratch.seen,
        &mut scratch.counts,
    )
}

/// Adds the modified ids with their modified values to the scan's candidates (the best
/// `keep` unmodified ids) and keeps the best `keep` of both.
fn merge_modifications(floor: f32, keep: usize, scratch: &mut Scratch) {
    let (ids, vals, cand) = (&scratch.mod_ids, &scratch.mod_vals, &mut scratch.cand);
    // With `keep` candidates already, a modified id must beat the worst of them.
    let worst = if cand.len() >= keep {
        cand.iter().map(rank_key).max()
    } else {
        None
    };
    for (&id, &v) in ids.iter().zip(vals) {
        if v > floor && worst.is_none_or(|w| rank_key_of(v, id) < w) {
            cand.push(Cand {
                logit: v,
                id,
                w: 0.0,
            });
        }
    }
    if cand.len() > keep {
        compact(cand, keep);
    }
}

/// Writable logits by token id: a dense row, or the sparse list of modified ids.
trait Slots {
    fn slot(&mut self, id: u32) -> &mut f32;
}

struct Dense<'a>(&'a mut [f32]);

impl Slots for Dense<'_> {
    #[inline]
    fn slot(&mut self, id: u32) -> &mut f32 {
        &mut self.0[id as usize]
    }
}

struct Sparse<'a> {
    /// Open-addressing table of `id << 32 | index in vals` (`u64::MAX`: empty), `2^bits` long.
    table: &'a [u64],
    bits: u32,
    vals: &'a mut [f32],
}

/// The home slot of `id` in a table of `2^bits` entries (Fibonacci hashing).
#[inline]
fn slot_hash(id: u32, bits: u32) -> usize {
    (id.wrapping_mul(0x9E37_79B9) >> (32 - bits)) as usize
}

impl Slots for Sparse<'_> {
    #[inline]
    fn slot(&mut self, id: u32) -> &mut f32 {
        // Every id steps 3-5 touch was listed by `list_modified_ids`, so the probe ends.
        let mask = self.table.len() - 1;
        let mut h = slot_hash(id, self.bits);
        loop {
            let e = self.table[h];
            if (e >> 32) as u32 == id || e == u64::MAX {
                debug_assert_ne!(e, u64::MAX, "id {id} was not listed");
                let slot = if e == u64::MAX { 0 } else { e as u32 as usize };
                return &mut self.vals[slot];
            }
            h = (h + 1) & mask;
        }
    }
}

/// Copies `row` into `logits` (only `allowed_token_ids` kept, when given) and applies steps
/// 3-5 to the copy ([`modify`]).
///
/// # Errors
/// As [`modify`].
fn apply_constraints_bias_penalties(
    row: &[f32],
    floor: f32,
    request: &SampleRequest<'_>,
    logits: &mut Vec<f32>,
    scratch: &mut Scratch,
) -> Result<(), SampleError> {
    let vocab = row.len();
    logits.clear();
    // Step 3: allowed_token_ids.
    match &request.params.allowed_token_ids {
        Some(allowed) => {
            logits.resize(vocab, floor);
            for &id in allowed {
                logits[id as usize] = row[id as usize];
            }
        }
        None => logits.extend_from_slice(row),
    }
    // Step 3: the token bitmask.
    if let Some(mask) = request.token_bitmask {
        crate::bitmask::mask_row(
            &mut logits[..vocab],
            &mask[..crate::bitmask::bitmask_words(vocab)],
            floor,
        );
    }
    modify(
        &mut Dense(&mut logits[..vocab]),
        floor,
        request,
        vocab,
        &mut scratch.seen,
        &mut scratch.counts,
    )
}

/// Applies, in the order of spec/sampling.md: step 3, the hard constraints `bad_words` and
/// `min_tokens` (set to `floor`); step 4, `logit_bias` added (clamped to ±100); step 5, the
/// repetition penalty `l > 0 ? l / r : l * r` once per distinct prompt or output id (CTRL;
/// Hugging Face's `RepetitionPenaltyLogitsProcessor`), then
/// `l -= count * frequency + (count > 0) * presence` over the output ids (OpenAI's
/// definitions). `seen` and `counts` are all-zero scratch buffers, left all zero.
///
/// # Errors
/// [`SampleError::PenaltyOverflow`] when the repetition penalty takes a finite logit out of
/// the f32 range.
fn modify(
    logits: &mut impl Slots,
    floor: f32,
    request: &SampleRequest<'_>,
    vocab: usize,
    seen: &mut Vec<u64>,
    counts: &mut Vec<u32>,
) -> Result<(), SampleError> {
    let params = request.params;
    let output = request.output_ids;
    for words in &params.bad_words {
        if let Some((&last, prefix)) = words.split_last() {
            if output.ends_with(prefix) {
                *logits.slot(last) = floor;
            }
        }
    }
    if output.len() < params.min_tokens {
        for &id in request.stop_token_ids {
            *logits.slot(id) = floor;
        }
    }
    // Step 4: logit bias.
    for (&id, &bias) in &params.logit_bias {
        let l = logits.slot(id);
        *l = (f64::from(*l) + bias.clamp(-LOGIT_BIAS_LIMIT, LOGIT_BIAS_LIMIT)) as f32;
    }
    // Step 5: repetition penalty, each distinct id of prompt + output once.
    let words = vocab.div_ceil(64);
    if seen.len() < words {
        seen.resize(words, 0);
    }
    let mut overflow = None;
    let penalty = params.repetition_penalty;
    if penalty != 1.0 {
        let r = penalty as f32;
        let ids = || request.prompt_ids.iter().chain(output);
        for &id in ids() {
            let (word, bit) = (id as usize / 64, 1u64 << (id % 64));
            if seen[word] & bit == 0 {
                seen[word] |= bit;
                let l = logits.slot(id);
                let before = *l;
                *l = if before > 0.0 { before / r } else { before * r };
                if before.is_finite() && !l.is_finite() && overflow.is_none() {
                    overflow = Some(SampleError::PenaltyOverflow {
                        token_id: id,
                        logit: before,
                        penalty,
                    });
                }
            }
        }
        for &id in ids() {
            seen[id as usize / 64] = 0;
        }
    }
    // Step 5, continued: frequency and presence over the output ids.
    let (frequency, presence) = (params.frequency_penalty, params.presence_penalty);
    if frequency != 0.0 || presence != 0.0 {
        if counts.len() < vocab {
            counts.resize(vocab, 0);
        }
        for &id in output {
            counts[id as usize] += 1;
        }
        for &id in output {
            let count = std::mem::take(&mut counts[id as usize]);
            if count > 0 {
                let l = logits.slot(id);
                *l = (f64::from(*l) - (f64::from(count) * frequency + presence)) as f32;
            }
        }
    }
    overflow.map_or(Ok(()), Err)
}

/// `(l - max) / T` in f32 (step 7). Two edges keep it exact for every finite input: -inf stays
/// -inf (so a temperature beyond the f32 range, where `T as f32` is inf, cannot make
/// `-inf / inf = NaN`), and a difference that overflows f32 (logits near ±f32::MAX) is formed
/// in f64.
#[inline]
fn scaled(l: f32, max: f32, t: f32, t64: f64) -> f32 {
    let d = l - max;
    if d == f32::NEG_INFINITY {
        if l == f32::NEG_INFINITY {
            return f32::NEG_INFINITY;
        }
        return ((f64::from(l) - f64::from(max)) / t64) as f32;
    }
    d / t
}

fn dense_weights(buf: &mut Vec<f32>, vocab: usize) -> &mut [f32] {
    if buf.len() < vocab {
        buf.resize(vocab, 0.0);
    }
    &mut buf[..vocab]
}

/// Parameters defined on logits only are an error with probability input (spec/sampling.md,
/// "Parameter edge values"); temperature 1 is accepted as the no-op it is.
fn check_probs_params(params: &SamplingParams) -> Result<(), SampleError> {
    let logits_only = "its default (it is defined on logits, not probabilities)";
    let bad = |field: &'static str, value: String| {
        Err(SampleError::InvalidParams(crate::error::ParamError {
            field,
            value,
            allowed: logits_only,
        }))
    };
    if !params.is_greedy() && params.temperature != 1.0 {
        return bad("temperature", params.temperature.to_string());
    }
    if params.repetition_penalty != 1.0 {
        return bad("repetition_penalty", params.repetition_penalty.to_string());
    }
    if params.presence_penalty != 0.0 {
        return bad("presence_penalty", params.presence_penalty.to_string());
    }
    if params.frequency_penalty != 0.0 {
        return bad("frequency_penalty", params.frequency_penalty.to_string());
    }
    if !params.logit_bias.is_empty() {
        return bad("logit_bias", format!("{:?}", params.logit_bias));
    }
    Ok(())
}

/// Whether any of steps 3-5 changes a logit of this request.
fn modifies_logits(request: &SampleRequest<'_>) -> bool {
    let p = request.params;
    let has_context = !(request.prompt_ids.is_empty() && request.output_ids.is_empty());
    p.allowed_token_ids.is_some()
        || request.token_bitmask.is_some()
        || !p.bad_words.is_empty()
        || (request.output_ids.len() < p.min_tokens && !request.stop_token_ids.is_empty())
        || !p.logit_bias.is_empty()
        || (p.repetition_penalty != 1.0 && has_context)
        || ((p.frequency_penalty != 0.0 || p.presence_penalty != 0.0)
            && !request.output_ids.is_empty())
}

/// The exactly-`k` best tokens (value desc, id asc) among the values above `floor`, into `out`
/// (unordered). Streams the row once: an element enters the buffer only if it beats the
/// current k-th best; a full buffer is cut back to k with a linear-time selection, raising
/// the threshold. Amortised O(1) per element.
fn top_k_candidates(logits: &[f32], floor: f32, k: usize, out: &mut Vec<Cand>) {
    let cap = (2 * k).max(k + 256);
    let mut threshold = floor;
    for (i, &l) in logits.iter().enumerate() {
        // Strict: an element equal to the current k-th best has a higher id, so it ranks lower.
        if l > threshold {
            out.push(Cand {
                logit: l,
                id: i as u32,
                w: 0.0,
            });
            if out.len() == cap {
                out.select_nth_unstable_by(k - 1, better);
                out.truncate(k);
                threshold = out[k - 1].logit;
            }
        }
    }
    if out.len() > k {
        out.select_nth_unstable_by(k - 1, better);
        out.truncate(k);
    }
}

/// Smallest-set top-p: rearranges `cand` so that `cand[..n]` is the shortest prefix, in the
/// (logit desc, id asc) order, whose weight is `>= target` (f64), and returns `n`. A prefix
/// that reaches the target exactly takes nothing more. Expected linear time (quickselect by
/// mass with a median-of-three pivot).
fn top_p_prefix(cand: &mut [Cand], mut target: f64) -> usize {
    let (mut lo, mut hi) = (0usize, cand.len());
    loop {
        if hi - lo <= 32 {
            let part = &mut cand[lo..hi];
            part.sort_unstable_by(better);
            let mut acc = 0.0f64;
            for (j, c) in part.iter().enumerate() {
                acc += f64::from(c.w);
                if acc >= target {
                    return lo + j + 1;
                }
            }
            // Rounding left the total just below the target: keep everything.
            return hi;
        }
        let mid = lo + (hi - lo) / 2;
        let pivot_at = median_of_three(cand, lo, mid, hi - 1);
        cand.swap(pivot_at, hi - 1);
        let pivot = cand[hi - 1];
        let mut store = lo;
        let mut mass = 0.0f64;
        for j in lo..hi - 1 {
            if better(&cand[j], &pivot) == Ordering::Less {
                mass += f64::from(cand[j].w);
                cand.swap(store, j);
                store += 1;
            }
        }
        cand.swap(store, hi - 1);
        // cand[lo..store] beats the pivot, now at `store`; cand[store+1..hi] is worse.
        if mass >= target {
            hi = store;
        } else if mass + f64::from(pivot.w) >= target {
            return store + 1;
        } else {
            target -= mass + f64::from(pivot.w);
            lo = store + 1;
        }
    }
}

fn median_of_three(c: &[Cand], a: usize, b: usize, d: usize) -> usize {
    let lt = |x: usize, y: usize| better(&c[x], &c[y]) == Ordering::Less;
    if lt(a, b) {
        if lt(b, d) {
            b
        } else if lt(a, d) {
            d
        } else {
            a
        }
    } else if lt(a, d) {
        a
    } else if lt(b, d) {
        d
    } else {
        b
    }
}

/// The f64 sum of weights given in ascending id order: sequential within each chunk of
/// [`CHUNK`] ids, then the chunk sums in order. Independent of how a row is split.
pub(crate) fn chunked_sum(items: impl Iterator<Item = (usize, f32)>) -> f64 {
    let mut total = 0.0f64;
    let mut partial = 0.0f64;
    let mut chunk = 0usize;
    for (id, w) in items {
        if id / CHUNK != chunk {
            total += partial;
            partial = 0.0;
            chunk = id / CHUNK;
        }
        partial += f64::from(w);
    }
    total + partial
}

/// Inverse-CDF selection (step 11) over survivors in ascending id order: the first token whose
/// cumulative weight exceeds `u * Z`; if rounding leaves the total below, the last token with
/// non-zero weight. Chunk sums as in [`chunked_sum`] locate the chunk first.
/// Returns (token, weight, Z, number of non-zero weights).
fn select_sparse(cand: &[Cand], u: f64) -> (u32, f32, f64, usize) {
    let z = chunked_sum(cand.iter().map(|c| (c.id as usize, c.w)));
    let target = u * z;
    let nonzero = cand.iter().filter(|c| c.w > 0.0).count();
    let last = cand.iter().rev().find(|c| c.w > 0.0).unwrap_or(&cand[0]);
    let mut acc = 0.0f64;
    let mut start = 0usize;
    while start < cand.len() {
        let chunk = cand[start].id as usize / CHUNK;
        let end = start
            + cand[start..]
                .iter()
                .position(|c| c.id as usize / CHUNK != chunk)
                .unwrap_or(cand.len() - start);
        let part: f64 = cand[start..end].iter().map(|c| f64::from(c.w)).sum();
        if acc + part > target {
            let mut a = acc;
            for c in &cand[start..end] {
                a += f64::from(c.w);
                if a > target {
                    return (c.id, c.w, z, nonzero);
                }
            }
        }
        acc += part;
        start = end;
    }
    (last.id, last.w, z, nonzero)
}

/// [`select_sparse`] over dense weights (zero for removed tokens); identical results.
pub(crate) fn select_dense(w: &[f32], u: f64) -> (u32, f32, f64, usize) {
    let z = chunked_sum(w.iter().copied().enumerate());
    let target = u * z;
    let nonzero = w.iter().filter(|&&x| x > 0.0).count();
    let mut acc = 0.0f64;
    for (c, chunk) in w.chunks(CHUNK).enumerate() {
        let part: f64 = chunk.iter().map(|&x| f64::from(x)).sum();
        if acc + part > target {
            let mut a = acc;
            for (j, &x) in chunk.iter().enumerate() {
                a += f64::from(x);
                if a > target {
                    return ((c * CHUNK + j) as u32, x, z, nonzero);
                }
            }
        }
        acc += part;
    }
    let last = w.iter().rposition(|&x| x > 0.0).unwrap_or(0);
    (last as u32, w[last], z, nonzero)
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
