//! Stochastic steps of llama.cpp (`src/llama-sampler.cpp`): XTC, a processor that draws a coin,
//! and the selection steps mirostat v1, mirostat v2 and adaptive-p, whose per-request state
//! (`mu`, the adaptive-p moving average) lives in the [`super::SamplerChain`].
//!
//! The selection maths are public functions over one processed row, so that the stateless
//! `SamplingParams` path (an engine carrying the state per request) and the chain run the same
//! code: [`Mirostat::weights`] / [`mirostat_update`], [`AdaptiveP::transform`] /
//! [`AdaptiveP::update`]. A row is `vocab_size` f32 logits, `-inf` for removed tokens; the
//! "candidates" of llama.cpp (which shrinks its array instead) are the finite logits.

use std::cell::Cell;

use super::passes;
use super::{better, row_max, LogitsProcessor, ProcessorContext};
use crate::error::{ParamError, SampleError};
use crate::kernels;
use crate::philox;
use crate::sampler::{collect, first_at_least, logit_cut, non_finite, rank_key, scan_top, Cand};

const NEG: f32 = f32::NEG_INFINITY;

/// Serde defaults of the chain's JSON entries (`config.rs`), llama.cpp's and its server's.
pub(super) mod defaults {
    /// `xtc_threshold`: 0.1.
    pub fn xtc_threshold() -> f64 {
        0.1
    }
    /// `min_keep`: 1.
    pub fn min_keep() -> usize {
        1
    }
    /// `mirostat_tau`: 5.
    pub fn mirostat_tau() -> f64 {
        5.0
    }
    /// `mirostat_eta`: 0.1.
    pub fn mirostat_eta() -> f64 {
        0.1
    }
    /// Mirostat v1's `m`: 100 (llama.cpp's common sampler hard-codes it).
    pub fn mirostat_m() -> usize {
        100
    }
    /// `adaptive_decay`: 0.9.
    pub fn adaptive_decay() -> f64 {
        0.9
    }
}

// ---------------------------------------------------------------------------------------------
// XTC
// ---------------------------------------------------------------------------------------------

/// XTC, "exclude top choices" (llama.cpp `src/llama-sampler.cpp`, `llama_sample_xtc_apply`;
/// oobabooga text-generation-webui PR 6335): with probability `probability` per row, removes
/// every token whose probability reaches `threshold` except the least likely of them, unless
/// that would leave fewer than `min_keep` candidates.
///
/// Algorithm, llama.cpp's comparisons in our representation:
/// 1. Off (the row is unchanged) when `probability <= 0` or `threshold > 0.5`, or when fewer
///    than two candidates (finite logits) are left.
/// 2. The coin `u = philox::uniform_kind(ctx.seed, ctx.position, ctx.sample_index,
///    draw::XTC)`; `u > probability` leaves the row unchanged (llama.cpp: `chance >
///    probability` returns).
/// 3. Probabilities `p_i = w_i / Z` over the candidates, `w_i = exp(l_i - max)` in f32 and `Z`
///    their f64 sum in fixed id chunks; order: logit descending (llama.cpp sorts by logit, and
///    `p` follows it), ties to the lower id.
/// 4. `pos_last` is the index, in that order, of the last token of the leading run with `p >=
///    threshold` (decided in f64), 0 when fewer than two reach it.
/// 5. If `candidates - pos_last >= min_keep` and `pos_last > 0`, the first `pos_last` tokens of
///    the order become `-inf` (llama.cpp advances its array past them).
///
/// Randomness: one uniform per row at counter `(ctx.position, ctx.sample_index, 1)` of the
/// request's stream; inside a [`super::SamplerChain`] `ctx.seed` is the selection's seed, so
/// the coin is the same for every sample `n` of the row. Applied on its own, `ctx.seed` is what
/// the caller set (0 by default).
///
/// Place in the chain: the result depends on what ran before (temperature and the filters
/// change the probabilities); llama.cpp puts it after min-p and before temperature, the fixed
/// `SamplingParams` path last before selection (spec step 10e). Stateless.
///
/// Cost: a count pass, one max pass, one exp pass for `Z`, a compare pass collecting the
/// tokens with `l - max >= ln(threshold)` (few unless the threshold is tiny) and one exp for
/// each of them, when the coin says apply; all vectorised, O(vocab), no allocation once warm.
#[derive(Clone, Debug)]
pub struct Xtc {
    threshold: f64,
    probability: f64,
    min_keep: usize,
    /// The tokens reaching the threshold: (logit, id).
    above: Vec<(f32, u32)>,
    /// The tokens above the logit cut (a superset of `above`).
    cand: Vec<Cand>,
}

impl Xtc {
    /// XTC with `threshold`, `probability` and `min_keep` (llama.cpp's defaults: 0.1, 0 = off,
    /// 1).
    ///
    /// # Errors
    /// [`ParamError`] for `xtc_threshold` outside `[0, 1]` (values above 0.5 are off, as in
    /// llama.cpp) or `xtc_probability` outside `[0, 1]` (0 is off); NaN is outside.
    pub fn new(threshold: f64, probability: f64, min_keep: usize) -> Result<Self, ParamError> {
        if !(0.0..=1.0).contains(&threshold) {
            return Err(ParamError::new(
                "xtc_threshold",
                threshold,
                "[0, 1] (above 0.5 disables it)",
            ));
        }
        if !(0.0..=1.0).contains(&probability) {
            return Err(ParamError::new(
                "xtc_probability",
                probability,
                "[0, 1] (0 disables it)",
            ));
        }
        Ok(Self {
            threshold,
            probability,
            min_keep,
            above: Vec::new(),
            cand: Vec::new(),
        })
    }

    /// The probability a token must reach to be excluded.
    pub fn threshold(&self) -> f64 {
        self.threshold
    }

    /// The chance per row that XTC applies.
    pub fn probability(&self) -> f64 {
        self.probability
    }

    /// The fewest candidates XTC leaves.
    pub fn min_keep(&self) -> usize {
        self.min_keep
    }

    /// Whether XTC can change a row at all (`probability > 0` and `threshold <= 0.5`).
    pub fn is_active(&self) -> bool {
        self.probability > 0.0 && self.threshold <= 0.5
    }
}

impl LogitsProcessor for Xtc {
    fn name(&self) -> &str {
        "xtc"
    }
    fn apply(&mut self, logits: &mut [f32], ctx: &ProcessorContext<'_>) -> Result<(), SampleError> {
        if !self.is_active() {
            return Ok(());
        }
        let candidates = passes::count_finite(logits);
        if candidates < 2 {
            return Ok(());
        }
        let u = philox::uniform_kind(ctx.seed, ctx.position, ctx.sample_index, philox::draw::XTC);
        if u > self.probability {
            return Ok(());
        }
        let max = row_max(logits);
        let z = passes::sum_exp(logits, max);
        // `p >= threshold` needs `w >= threshold * Z >= threshold` (Z >= 1, the max's weight is
        // 1), so `l - max >= ln(threshold)` up to exp's rounding: a vectorised collection of
        // the tokens above a logit cut with a margin (-inf for threshold 0: every candidate),
        // then the exact f64 test.
        let floor = self.threshold.ln() - 1e-4;
        let cut = if floor == f64::NEG_INFINITY {
            NEG
        } else {
            logit_cut(max, floor - 1e-3, 1.0)
        };
        self.cand.clear();
        collect(logits, NEG, cut, &mut self.cand, false);
        self.above.clear();
        for c in &self.cand {
            let (i, l) = (c.id, c.logit);
            let d = l - max;
            if l != NEG
                && f64::from(d) >= floor
                && f64::from(crate::kernels::exp_w(d)) / z >= self.threshold
            {
                self.above.push((l + 0.0, i));
            }
        }
        let reached = self.above.len();
        let pos_last = reached.saturating_sub(1);
        if pos_last == 0 || candidates - pos_last < self.min_keep {
            return Ok(());
        }
        // The least likely of them (last in the order) stays; the others go.
        self.above.select_nth_unstable_by(pos_last, better);
        for &(_, id) in &self.above[..pos_last] {
            logits[id as usize] = NEG;
        }
        Ok(())
    }
    fn box_clone(&self) -> Box<dyn LogitsProcessor> {
        Box::new(self.clone())
    }
}

// ---------------------------------------------------------------------------------------------
// Mirostat
// ---------------------------------------------------------------------------------------------

/// Which mirostat (Basu et al. 2020, "Mirostat: a neural text decoding algorithm that directly
/// controls perplexity", arXiv 2007.14966).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MirostatVersion {
    /// Mirostat 1.0: top-k with `k` from a Zipf estimate over the `m` most probable tokens.
    V1 {
        /// The tokens in the Zipf exponent's estimate (llama.cpp's server uses 100).
        m: usize,
    },
    /// Mirostat 2.0: keeps the tokens whose surprise is at most `mu`.
    V2,
}

/// Mirostat's parameters, validated: the version, the target surprise `tau` (bits) and the
/// learning rate `eta`. The state is `mu`, starting at [`Self::initial_mu`] (`2 tau`); the
/// caller carries it per request (the chain does, in [`super::SamplerChain`]).
///
/// One step: [`Self::weights`] truncates the row for the current `mu`; a token is drawn from
/// those weights (inverse CDF in token-id order, spec step 11); once the token is committed,
/// [`mirostat_update`] moves `mu` by the token's surprise under the truncated distribution.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Mirostat {
    version: MirostatVersion,
    tau: f64,
    eta: f64,
}

impl Mirostat {
    /// Mirostat 1.0 (llama.cpp `llama_sampler_init_mirostat`; defaults tau 5, eta 0.1, m 100).
    ///
    /// # Errors
    /// [`ParamError`] for `mirostat_tau` or `mirostat_eta` unless finite and `>= 0`, and for
    /// `mirostat_m` below 2 (the estimate needs a pair of tokens).
    pub fn v1(tau: f64, eta: f64, m: usize) -> Result<Self, ParamError> {
        if m < 2 {
            return Err(ParamError::new(
                "mirostat_m",
                m,
                ">= 2 (the tokens in the estimate of s_hat)",
            ));
        }
        Self::checked(MirostatVersion::V1 { m }, tau, eta)
    }

    /// Mirostat 2.0 (llama.cpp `llama_sampler_init_mirostat_v2`; defaults tau 5, eta 0.1).
    ///
    /// # Errors
    /// [`ParamError`] for `mirostat_tau` or `mirostat_eta` unless finite and `>= 0`.
    pub fn v2(tau: f64, eta: f64) -> Result<Self, ParamError> {
        Self::checked(MirostatVersion::V2, tau, eta)
    }

    fn checked(version: MirostatVersion, tau: f64, eta: f64) -> Result<Self, ParamError> {
        for (field, value) in [("mirostat_tau", tau), ("mirostat_eta", eta)] {
            if !(value.is_finite() && value >= 0.0) {
                return Err(ParamError::new(field, value, "a finite number >= 0"));
            }
        }
        Ok(Self { version, tau, eta })
    }

    /// The version (and v1's `m`).
    pub fn version(&self) -> MirostatVersion {
        self.version
    }

    /// The target surprise, in bits.
    pub fn tau(&self) -> f64 {
        self.tau
    }

    /// The learning rate.
    pub fn eta(&self) -> f64 {
        self.eta
    }

    /// `mu` at the start of a request: `2 tau` (llama.cpp's init and reset).
    pub fn initial_mu(&self) -> f64 {
        2.0 * self.tau
    }

    /// `mu` after committing a token of probability `p_token` (see [`mirostat_update`]).
    pub fn update(&self, mu: f64, p_token: f64) -> f64 {
        mirostat_update(mu, p_token, self.tau, self.eta)
    }

    /// The truncated distribution of one row for the state `mu`, as weights.
    ///
    /// Arguments: `logits`, one processed row of `vocab_size = logits.len()` f32 logits
    /// (`-inf` removed), free of NaN and `+inf`; `mu`, the request's state; `weights`, filled
    /// with `vocab_size` values: `exp(l_i - max)` in f32 for the kept tokens, 0 for the others.
    /// Returns `Z`, the f64 sum of the weights in fixed id chunks: token `i` has probability
    /// `weights[i] / Z` (renormalised after truncation, as llama.cpp's second softmax).
    ///
    /// v1 (`llama_sampler_mirostat_apply`), over the candidates in the order (logit
    /// descending, ties to the lower id), `n_vocab = logits.len()`:
    /// - `s_hat = sum(t_i b_i) / sum(t_i^2)` over `i < min(m - 1, candidates - 1)`, with
    ///   `t_i = ln((i + 2) / (i + 1))` and `b_i = ln(p_i / p_{i+1})`, computed exactly as the
    ///   f64 difference of the two logits (llama.cpp's f32 ratio of softmax probabilities
    ///   underflows when `p_{i+1}` does);
    /// - `eps = s_hat - 1`, `k = (eps 2^mu / (1 - n_vocab^-eps))^(1 / s_hat)` in f64;
    /// - keeps the `max(trunc(k), 1)` best candidates (all if `k` is that many or more).
    ///   `k` NaN (one candidate, where `s_hat` is 0/0, or `s_hat == 1` exactly) keeps 1, which
    ///   is what llama.cpp's `std::max(int(k), 1)` gives on x86; a `k` beyond `int`'s range
    ///   (`mu` large) is undefined behaviour in C++ (1 on x86) and saturates here: it keeps
    ///   every candidate, the limit of the formula.
    ///
    /// v2 (`llama_sampler_mirostat_v2_apply`): keeps the candidates with surprise
    /// `-log2(p_i) <= mu` (llama.cpp cuts its sorted array at the first `-log2(p) > mu`),
    /// decided in f64 as `w_i >= Z 2^-mu`; if none is kept, the most probable token (lowest id
    /// among ties).
    ///
    /// Cost: v1 one vectorised pass for the `m` best (the fast path's top-k scan), a sort of
    /// those `m`, a second such pass only when `k > m` (for the `k`-th best), then one exp pass
    /// and the sum: the bottleneck is the exp pass, as for plain sampling. v2 one exp pass, the
    /// sum, one compare pass and the sum of the kept. O(vocab), no allocation once warm (v1
    /// keeps its `m` best in a per-thread buffer).
    ///
    /// # Errors
    /// [`SampleError::NonFiniteLogits`] for a NaN or `+inf` logit, [`SampleError::NoCandidates`]
    /// when every logit is `-inf`.
    pub fn weights(
        &self,
        logits: &[f32],
        mu: f64,
        weights: &mut Vec<f32>,
    ) -> Result<f64, SampleError> {
        let mut top = TOP.with(Cell::take);
        let z = self.weights_with(logits, mu, weights, &mut top);
        TOP.with(|t| t.set(top));
        z
    }

    /// [`Self::weights`] with the caller's candidate buffer.
    pub(crate) fn weights_with(
        &self,
        logits: &[f32],
        mu: f64,
        weights: &mut Vec<f32>,
        top: &mut Vec<Cand>,
    ) -> Result<f64, SampleError> {
        match self.version {
            MirostatVersion::V1 { m } => v1_weights(logits, m, mu, weights, top),
            MirostatVersion::V2 => v2_weights(logits, mu, weights),
        }
    }
}

thread_local! {
    /// [`Mirostat::weights`]'s buffer of the best candidates, reused across rows.
    static TOP: Cell<Vec<Cand>> = const { Cell::new(Vec::new()) };
}

/// `mu - eta (s - tau)` with `s = -log2(p_token)`, the surprise in bits of the committed token
/// under the truncated distribution that it was drawn from (llama.cpp's update at the end of
/// both mirostat applies; here it runs when the token is accepted). `p_token` must be in
/// `(0, 1]` (a token of that distribution): 0 gives `-inf`.
pub fn mirostat_update(mu: f64, p_token: f64, tau: f64, eta: f64) -> f64 {
    mu - eta * (-p_token.log2() - tau)
}

/// The truncated distribution of [`Mirostat::weights`] as `(token id, probability)` pairs in
/// ascending id order (allocates; the weights form does not).
///
/// # Errors
/// As [`Mirostat::weights`].
pub fn mirostat_distribution(
    logits: &[f32],
    mirostat: &Mirostat,
    mu: f64,
) -> Result<Vec<(u32, f64)>, SampleError> {
    let mut w = Vec::new();
    let z = mirostat.weights(logits, mu, &mut w)?;
    Ok(w.iter()
        .enumerate()
        .filter(|(_, &x)| x > 0.0)
        .map(|(i, &x)| (i as u32, f64::from(x) / z))
        .collect())
}

fn v1_weights(
    logits: &[f32],
    m: usize,
    mu: f64,
    weights: &mut Vec<f32>,
    top: &mut Vec<Cand>,
) -> Result<f64, SampleError> {
    let n_vocab = logits.len();
    let wanted = m.min(n_vocab).max(1);
    if scan_top(logits, NEG, wanted, &[], top, false) {
        return Err(non_finite(logits));
    }
    if top.is_empty() {
        return Err(SampleError::NoCandidates);
    }
    top.sort_unstable_by_key(rank_key);
    let max = top[0].logit;
    // Pairs i < min(m - 1, candidates - 1) = top.len() - 1.
    let (mut num, mut den) = (0.0f64, 0.0f64);
    for i in 0..top.len() - 1 {
        let t = ((i + 2) as f64 / (i + 1) as f64).ln();
        let b = f64::from(top[i].logit) - f64::from(top[i + 1].logit);
        num += t * b;
        den += t * t;
    }
    let s_hat = num / den;
    let eps = s_hat - 1.0;
    let k = ((eps * mu.exp2()) / (1.0 - (n_vocab as f64).powf(-eps))).powf(1.0 / s_hat);
    // `as` truncates toward zero and saturates (NaN to 0).
    let k = if k.is_nan() { 1 } else { (k as usize).max(1) };
    // The k-th best candidate, or None when k covers every candidate.
    let kth = if k <= top.len() {
        Some(top[k - 1])
    } else if top.len() < wanted {
        None
    } else {
        let _ = scan_top(logits, NEG, k.min(n_vocab), &[], top, false);
        if top.len() < k {
            None
        } else {
            top.iter().max_by_key(|c| rank_key(c)).copied()
        }
    };
    match kth {
        None => passes::exp_weights(logits, max, weights),
        Some(c) => {
            weights.resize(logits.len(), 0.0);
            passes::exp_ranked_at_most(logits, max, c.logit, c.id, weights);
        }
    }
    Ok(passes::sum_weights(weights))
}

fn v2_weights(logits: &[f32], mu: f64, weights: &mut Vec<f32>) -> Result<f64, SampleError> {
    let (max, bad) = kernels::max_bad(logits);
    if bad {
        return Err(non_finite(logits));
    }
    if max == NEG {
        return Err(SampleError::NoCandidates);
    }
    passes::exp_weights(logits, max, weights);
    let z = passes::sum_weights(weights);
    // -log2(w / Z) > mu  <=>  w < Z 2^-mu.
    let cut = z * (-mu).exp2();
    if !passes::zero_weights_below(weights, cut) {
        let first = first_at_least(logits, max).unwrap_or(0);
        weights[first] = 1.0;
    }
    Ok(passes::sum_weights(weights))
}

// ---------------------------------------------------------------------------------------------
// Adaptive-p
// ---------------------------------------------------------------------------------------------

/// Adaptive-p's width of the probability distance (llama.cpp `DISTRIBUTION_WIDTH`).
pub const ADAPTIVE_P_WIDTH: f64 = 0.3;
/// Adaptive-p's logit of a token exactly on target (llama.cpp `PEAK_LOGIT_VALUE`).
pub const ADAPTIVE_P_PEAK: f64 = 5.0;
/// Adaptive-p's curve steepness (llama.cpp `SHARPNESS`).
pub const ADAPTIVE_P_SHARPNESS: f64 = 10.0;

/// Adaptive-p's state per request: an exponential moving average of the *original*
/// (pre-transform) probabilities of the committed tokens, `weighted_sum = sum p_j decay^j` and
/// `total_weight = sum decay^j` (llama.cpp's fields of the same names).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AdaptivePState {
    /// `sum p_j decay^j`, newest token first.
    pub weighted_sum: f64,
    /// `sum decay^j`, converging to `1 / (1 - decay)`.
    pub total_weight: f64,
}

/// Adaptive-p (llama.cpp `llama_sampler_init_adaptive_p`, ggml-org/llama.cpp PR 17927): a
/// selection that favours tokens whose probability is near a target, steering the running
/// average of the chosen tokens' probabilities toward `target`.
///
/// Followed from llama.cpp's `src/llama-sampler.cpp` (`llama_sampler_adaptive_p_apply`,
/// `_accept`, `_reset`, `_clone`) and `include/llama.h`, as stored in a llama.cpp fork carrying
/// PR 17927 (AmesianX/TurboQuant; the stored ggml-org copy predates it). One step:
/// 1. `p_i = w_i / Z` over the candidates (`w_i = exp(l_i - max)` in f32, `Z` the f64 sum):
///    the original probabilities.
/// 2. `target < 0`: off, the step is plain sampling from `p` and the state never moves.
/// 3. The adapted target `a = clamp(2 clamp(target, 0, 1) - weighted_sum / total_weight, 0, 1)`
///    (`target` itself when `total_weight == 0`, which the state never reaches).
/// 4. Every candidate's logit becomes `PEAK - SHARPNESS d^2 / (1 + d)` with
///    `d = |p_i - a| / WIDTH` (in f32, the stored type, as llama.cpp computes it; `-inf`
///    stays `-inf`): quadratic near the
///    target, linear in the tails. Constants [`ADAPTIVE_P_PEAK`] 5, [`ADAPTIVE_P_SHARPNESS`]
///    10, [`ADAPTIVE_P_WIDTH`] 0.3.
/// 5. The token is drawn from the softmax of the new logits (inverse CDF in token-id order).
/// 6. When the token is committed: `weighted_sum = p_token + decay weighted_sum`,
///    `total_weight = 1 + decay total_weight`, with `p_token` its original probability of
///    step 1 ([`Self::update`]).
///
/// The state starts (and resets) at `weighted_sum = target / (1 - decay)`, `total_weight = 1 /
/// (1 - decay)` ([`Self::initial_state`]): the average starts on target.
///
/// Place in the chain: it is a selection, last; llama.cpp recommends only mild truncation
/// (min-p) before it. Cost: two exp passes (original and transformed weights), the sums, and
/// one pass of a division and a few multiplications per candidate; O(vocab).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AdaptiveP {
    target: f64,
    decay: f64,
}

impl AdaptiveP {
    /// Adaptive-p with `target` and `decay` (llama.cpp's server defaults: target -1 = off,
    /// decay 0.9).
    ///
    /// # Errors
    /// [`ParamError`] for `adaptive_target` unless finite and `<= 1` (negative disables it),
    /// and for `adaptive_decay` outside `[0, 0.99]`. llama.cpp clamps both into these ranges,
    /// its documented valid ranges; values outside are errors here, never silently clamped.
    pub fn new(target: f64, decay: f64) -> Result<Self, ParamError> {
        if !(target.is_finite() && target <= 1.0) {
            return Err(ParamError::new(
                "adaptive_target",
                target,
                "a finite number <= 1 ([0, 1]; negative disables it)",
            ));
        }
        if !(0.0..=0.99).contains(&decay) {
            return Err(ParamError::new("adaptive_decay", decay, "[0, 0.99]"));
        }
        Ok(Self { target, decay })
    }

    /// The target probability (negative: off).
    pub fn target(&self) -> f64 {
        self.target
    }

    /// The moving average's decay.
    pub fn decay(&self) -> f64 {
        self.decay
    }

    /// Whether the target is negative: plain sampling, no state.
    pub fn is_off(&self) -> bool {
        self.target < 0.0
    }

    /// The state at the start of a request.
    pub fn initial_state(&self) -> AdaptivePState {
        adaptive_p_initial_state(self.target, self.decay)
    }

    /// The adapted target of step 3 for `state`.
    pub fn adapted_target(&self, state: &AdaptivePState) -> f64 {
        let target = self.target.clamp(0.0, 1.0);
        let raw = if state.total_weight == 0.0 {
            target
        } else {
            2.0 * target - state.weighted_sum / state.total_weight
        };
        raw.clamp(0.0, 1.0)
    }

    /// The state after committing a token whose original probability (step 1) was
    /// `p_original`.
    pub fn update(&self, state: AdaptivePState, p_original: f64) -> AdaptivePState {
        adaptive_p_update(state, p_original, self.decay)
    }

    /// Steps 1-4 on one processed row, in place.
    ///
    /// Arguments: `logits`, `vocab_size = logits.len()` f32 logits (`-inf` removed), free of
    /// NaN and `+inf`, overwritten with the transformed logits (unchanged when off);
    /// `original`, filled with the `vocab_size` original weights `exp(l_i - max)` (f32, 0 for
    /// removed tokens). Returns their f64 sum `Z`: a token's original probability is
    /// `original[i] / Z`. The caller then samples from the softmax of the transformed row
    /// (weights `exp(l - max')`, as plain sampling) and, once a token is committed, calls
    /// [`Self::update`] with its original probability.
    ///
    /// # Errors
    /// [`SampleError::NonFiniteLogits`] for a NaN or `+inf` logit, [`SampleError::NoCandidates`]
    /// when every logit is `-inf`.
    pub fn transform(
        &self,
        logits: &mut [f32],
        state: &AdaptivePState,
        original: &mut Vec<f32>,
    ) -> Result<f64, SampleError> {
        let (max, bad) = kernels::max_bad(logits);
        if bad {
            return Err(non_finite(logits));
        }
        if max == NEG {
            return Err(SampleError::NoCandidates);
        }
        // The original probabilities are a statistic (the transform's input and the state's
        // update), not the weights drawn from: the fused exp-and-sum pass.
        let z = passes::exp_weights_sum(logits, max, original);
        if self.is_off() {
            return Ok(z);
        }
        passes::adaptive_p_logits(logits, original, z, self.adapted_target(state));
        Ok(z)
    }
}

/// [`AdaptiveP::initial_state`] without validation (the chain's state of a selection that may
/// not be valid yet).
pub(crate) fn adaptive_p_initial_state(target: f64, decay: f64) -> AdaptivePState {
    AdaptivePState {
        weighted_sum: target / (1.0 - decay),
        total_weight: 1.0 / (1.0 - decay),
    }
}

/// [`AdaptiveP::update`]: `weighted_sum = p + decay weighted_sum`, `total_weight = 1 + decay
/// total_weight` (llama.cpp `llama_sampler_adaptive_p_accept`).
pub fn adaptive_p_update(state: AdaptivePState, p_original: f64, decay: f64) -> AdaptivePState {
    AdaptivePState {
        weighted_sum: p_original + decay * state.weighted_sum,
        total_weight: 1.0 + decay * state.total_weight,
    }
}
