//! Filters (spec/sampling.md steps 8-10): processors that keep a subset of the candidates.
//!
//! Every filter with a `min_keep` (Hugging Face's `min_tokens_to_keep`) never leaves fewer than
//! `min_keep` tokens when the row has that many finite logits: the best by (logit descending,
//! id ascending), exactly `min_keep` of them where the filter alone would keep fewer (our ties
//! go to the lower id, where Hugging Face's `scores < topk(scores, k)[-1]` keeps every token
//! tied with the k-th). `min_keep` is at least 1 (Hugging Face: "a positive integer"); 1 is the
//! default and changes nothing.

use super::{row_max, LogitsProcessor, ProcessorContext};
use crate::error::{ParamError, SampleError};
use crate::sampler::{collect, first_at_least, logit_cut, rank_key, scan_top, top_p_prefix, Cand};

/// Checks a `min_keep`: at least 1.
pub(crate) fn check_min_keep(min_keep: usize) -> Result<usize, ParamError> {
    if min_keep == 0 {
        return Err(ParamError::new(
            "min_keep",
            min_keep,
            ">= 1 (the number of best tokens a filter never removes)",
        ));
    }
    Ok(min_keep)
}

/// Keeps exactly the `k` best finite logits, in the order (logit descending, id ascending),
/// and writes `-inf` over the others; a row with at most `k` finite logits is unchanged.
/// O(vocab): the fixed path's vectorised `scan_top` into `buf`, then a mask pass.
pub(crate) fn keep_best(logits: &mut [f32], k: usize, buf: &mut Vec<Cand>) {
    if k == 0 || k >= logits.len() {
        return;
    }
    // The fixed path's vectorised scan for the exactly-k best (unordered), then one mask pass.
    scan_top(logits, f32::NEG_INFINITY, k, &[], buf, false);
    if buf.len() < k {
        return;
    }
    let Some(&kth) = buf.iter().max_by_key(|c| rank_key(c)) else {
        return;
    };
    super::passes::mask_ranked_after(logits, kth.logit, kth.id);
}

/// Removes the tokens whose probability is below `threshold` (decided as `w < threshold * z`
/// in f64), unless that leaves fewer than `min_keep`: then exactly the `min_keep` best remain
/// ([`keep_best`]). `w` holds
/// the row's weights `exp(l - max)` (0 for `-inf`), `z` their sum. The survivors of a
/// probability threshold are the best tokens (the weights rise with the logit), so the
/// `min_keep` best contain them.
pub(crate) fn cut_below(
    logits: &mut [f32],
    w: &[f32],
    z: f64,
    threshold: f64,
    min_keep: usize,
    buf: &mut Vec<Cand>,
) {
    let cut = threshold * z;
    let too_few = if min_keep > 1 {
        super::passes::count_weight_at_least(logits, w, cut) < min_keep
    } else {
        // The best token's weight is exp(0) = 1, the largest: if it is below, all are.
        1.0 < cut
    };
    if too_few {
        keep_best(logits, min_keep, buf);
        return;
    }
    super::passes::mask_weight_below(logits, w, cut);
}

/// Min-p: keeps the tokens whose probability is `>= min_p * p_max`, ties with the threshold
/// kept (spec step 8; Nguyen et al. 2024, vLLM, llama.cpp). The probabilities are the weights
/// `exp(l - max)` in f32 (so `p_max`'s weight is 1) and the decision `w >= min_p` is made in
/// f64. 0 is off. Stateless.
///
/// `min_keep` (Hugging Face `MinPLogitsWarper`'s `min_tokens_to_keep`, default 1): the
/// `min_keep` most probable tokens are never removed; when fewer pass the threshold, exactly
/// the `min_keep` best remain (ties to the lower id). With `min_keep` 1 nothing changes (the
/// maximum always passes).
///
/// Place in the chain: a threshold relative to the most likely token: a temperature before it changes the
/// probabilities it compares (so its set), a shift does not; after other filters it sees their
/// survivors only.
#[derive(Clone, Debug)]
pub struct MinP {
    p: f64,
    min_keep: usize,
    /// The survivors (logit, id).
    buf: Vec<Cand>,
}

impl PartialEq for MinP {
    /// The parameters (not the buffer).
    fn eq(&self, other: &Self) -> bool {
        self.p == other.p && self.min_keep == other.min_keep
    }
}

impl MinP {
    /// Min-p `p`, `min_keep` 1.
    ///
    /// # Errors
    /// [`ParamError`] for `min_p` outside `[0, 1]`.
    pub fn new(p: f64) -> Result<Self, ParamError> {
        if !(0.0..=1.0).contains(&p) {
            return Err(ParamError::new("min_p", p, "[0, 1]"));
        }
        Ok(Self {
            p,
            min_keep: 1,
            buf: Vec::new(),
        })
    }

    /// The same filter keeping at least the `min_keep` best tokens.
    ///
    /// # Errors
    /// [`ParamError`] for `min_keep` 0.
    pub fn with_min_keep(mut self, min_keep: usize) -> Result<Self, ParamError> {
        self.min_keep = check_min_keep(min_keep)?;
        Ok(self)
    }

    /// The threshold.
    pub fn p(&self) -> f64 {
        self.p
    }

    /// The number of best tokens never removed.
    pub fn min_keep(&self) -> usize {
        self.min_keep
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
        // `w >= p` needs `l - max >= ln(p)` up to exp's rounding: collect the tokens above a
        // logit cut with a margin far above it (a vectorised compare pass, as the fixed path's
        // min-p), decide those exactly, and write the survivors back over a row of -inf.
        let cut = logit_cut(max, self.p.ln() - 1e-3, 1.0);
        self.buf.clear();
        collect(logits, f32::NEG_INFINITY, cut, &mut self.buf, false);
        let p = self.p;
        self.buf
            .retain(|c| f64::from(crate::kernels::exp_w(c.logit - max)) >= p);
        if self.buf.len() < self.min_keep {
            keep_best(logits, self.min_keep, &mut self.buf);
            return Ok(());
        }
        logits.fill(f32::NEG_INFINITY);
        for c in &self.buf {
            logits[c.id as usize] = c.logit;
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
///
/// `min_keep` (Hugging Face `TopKLogitsWarper`'s `min_tokens_to_keep`, default 1): an enabled
/// top-k keeps `max(k, min_keep)` tokens, as `top_k = max(top_k, min_tokens_to_keep)` there;
/// an off top-k stays off.
///
/// Place in the chain: the k largest logits are the same under any temperature or shift, so it commutes with
/// those; after another filter it counts only that filter's survivors.
#[derive(Clone, Debug)]
pub struct TopK {
    k: usize,
    min_keep: usize,
    buf: Vec<Cand>,
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
            min_keep: 1,
            buf: Vec::new(),
        })
    }

    /// The same filter keeping at least the `min_keep` best tokens when it is on.
    ///
    /// # Errors
    /// [`ParamError`] for `min_keep` 0.
    pub fn with_min_keep(mut self, min_keep: usize) -> Result<Self, ParamError> {
        self.min_keep = check_min_keep(min_keep)?;
        Ok(self)
    }

    /// `k` (0 when off).
    pub fn k(&self) -> usize {
        self.k
    }

    /// The number of best tokens never removed.
    pub fn min_keep(&self) -> usize {
        self.min_keep
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
        if self.k == 0 {
            return Ok(());
        }
        keep_best(logits, self.k.max(self.min_keep), &mut self.buf);
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
/// Stateless; expected O(n) in the number `n` of finite logits: the fixed path's quickselect
/// by mass (`sampler/select.rs`, `top_p_prefix`) in a buffer kept across calls, no sort.
///
/// `min_keep` (Hugging Face `TopPLogitsWarper`'s `min_tokens_to_keep`, default 1): the prefix
/// is at least `min_keep` long (the `min_keep` most probable are never removed).
///
/// Place in the chain: a cumulative-mass rule: a temperature before it changes the set, a shift does not;
/// after another filter it renormalises over that filter's survivors.
#[derive(Clone, Debug)]
pub struct TopP {
    p: f64,
    min_keep: usize,
    /// (logit, id, weight).
    buf: Vec<Cand>,
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
        Ok(Self {
            p,
            min_keep: 1,
            buf: Vec::new(),
        })
    }

    /// The same filter keeping at least the `min_keep` best tokens.
    ///
    /// # Errors
    /// [`ParamError`] for `min_keep` 0.
    pub fn with_min_keep(mut self, min_keep: usize) -> Result<Self, ParamError> {
        self.min_keep = check_min_keep(min_keep)?;
        Ok(self)
    }

    /// The mass to reach.
    pub fn p(&self) -> f64 {
        self.p
    }

    /// The number of best tokens never removed.
    pub fn min_keep(&self) -> usize {
        self.min_keep
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
        // `Z` from the fixed path's online max + sum-of-exp pass (its normaliser, within 1e-6
        // relative of the sum of the weights; the fixed path's top-p uses the same), the exact
        // f32-weight sum where `l - max` could leave f32.
        let z = if max <= 1e30 {
            crate::kernels::max_sum_exp(logits, 1.0).sum
        } else {
            super::passes::sum_exp(logits, max)
        };
        let target = self.p * z;
        // The boundary: the worst-ranked token of the shortest prefix (logit descending, id
        // ascending) whose weight reaches `p z`, and that prefix's length.
        let (n, kl, kid) = if 1.0 >= target {
            // The best token alone (weight exp(0) = 1) holds `p z`: the lowest id at the max.
            let id = first_at_least(logits, max).unwrap_or(0);
            (1, max, id as u32)
        } else {
            // The tokens ranked at or after the boundary weigh more than `(1 - p) z`; were the
            // boundary's weight below `eps = (1 - p) z / vocab`, they would all weigh less than
            // `eps`, so less than `(1 - p) z` together. So only tokens with weight `>= eps`
            // can be in the prefix: collect those (a logit cut with a margin far above exp_w's
            // rounding), as the fixed path's top-p does.
            let eps = (1.0 - self.p) * z / logits.len() as f64;
            let cut = if eps > 0.0 {
                logit_cut(max, eps.ln() - 1e-3, 1.0)
            } else {
                f32::NEG_INFINITY
            };
            self.buf.clear();
            collect(logits, f32::NEG_INFINITY, cut, &mut self.buf, false);
            for c in &mut self.buf {
                c.logit += 0.0;
                c.w = crate::kernels::exp_w(c.logit - max);
            }
            // The fixed path's linear-time smallest-set search (expected O(n), no sort).
            let n = top_p_prefix(&mut self.buf, target);
            let worst = self.buf[..n]
                .iter()
                .max_by_key(|c| rank_key(c))
                .copied()
                .expect("the prefix holds the best token");
            (n, worst.logit, worst.id)
        };
        if n < self.min_keep {
            // The prefix is the `n` best; the `min_keep` best contain it.
            keep_best(logits, self.min_keep, &mut self.buf);
            return Ok(());
        }
        super::passes::mask_ranked_after(logits, kl, kid);
        Ok(())
    }
    fn box_clone(&self) -> Box<dyn LogitsProcessor> {
        Box::new(self.clone())
    }
}

/// Top-n-sigma: keeps the tokens whose logit is `>= max - n * sigma`, `sigma` the population
/// standard deviation of the finite logits (Tang et al. 2024, "Top-nσ: Not All Logits Are You
/// Need"; llama.cpp `src/llama-sampler.cpp`, `llama_sampler_top_n_sigma_apply`). As there, the
/// mean and the deviation are over the candidates (llama.cpp skips `-inf` entries, our
/// removed tokens), the variance divides by their count, and `l < max - n * sigma` is removed;
/// here in f64 (llama.cpp: f32 sums). `n <= 0` is off (llama.cpp's `n <= 0` early return;
/// its server default -1), as is a row with at most one finite logit. Stateless; three passes
/// over the row (mean, deviation, mask), no allocation.
///
/// Place in the chain: a temperature `T` before it scales the logits, the maximum and `sigma`
/// alike, so the set it keeps does not change (up to the rounding of `l / T` in f32: it commutes
/// with [`super::Temperature`]); a penalty or bias before it changes the statistics.
#[derive(Clone, Debug, PartialEq)]
pub struct TopNSigma {
    n: f64,
}

impl TopNSigma {
    /// Top-n-sigma `n`.
    ///
    /// # Errors
    /// [`ParamError`] for `top_n_sigma` NaN or infinite (`n <= 0` is off).
    pub fn new(n: f64) -> Result<Self, ParamError> {
        if !n.is_finite() {
            return Err(ParamError::new(
                "top_n_sigma",
                n,
                "a finite number (<= 0 disables it)",
            ));
        }
        Ok(Self { n })
    }

    /// `n`.
    pub fn n(&self) -> f64 {
        self.n
    }
}

impl LogitsProcessor for TopNSigma {
    fn name(&self) -> &str {
        "top_n_sigma"
    }
    fn apply(
        &mut self,
        logits: &mut [f32],
        _ctx: &ProcessorContext<'_>,
    ) -> Result<(), SampleError> {
        if self.n <= 0.0 {
            return Ok(());
        }
        let super::passes::Moments { count, sum, max } = super::passes::finite_moments(logits);
        if count <= 1 {
            return Ok(());
        }
        let mean = sum / count as f64;
        let sq = super::passes::squared_deviation(logits, mean);
        let sigma = (sq / count as f64).sqrt();
        let threshold = f64::from(max) - self.n * sigma;
        super::passes::mask_below(logits, threshold);
        Ok(())
    }
    fn box_clone(&self) -> Box<dyn LogitsProcessor> {
        Box::new(self.clone())
    }
}

/// Epsilon sampling: removes the tokens whose probability is below `epsilon`, keeping at least
/// the `min_keep` most probable (Hewitt et al. 2022, "Truncation Sampling as Language Model
/// Desmoothing"; Hugging Face `src/transformers/generation/logits_process.py`,
/// `EpsilonLogitsWarper`: `probabilities < epsilon` removed unless among the top
/// `min_tokens_to_keep`). The probabilities are the softmax of the finite logits: weights
/// `exp(l - max)` in f32, their sum `z` in f64 (fixed id chunks), `w < epsilon * z` decided in
/// f64; a probability equal to `epsilon` stays. When fewer than `min_keep` reach `epsilon`,
/// exactly the `min_keep` best remain (ties to the lower id; Hugging Face keeps every token
/// tied with the `min_keep`-th logit). Stateless; a max pass, an exp pass, a mask pass (and a
/// count pass when `min_keep > 1`), buffers kept across calls.
///
/// Place in the chain: a fixed probability threshold, so its result depends on everything
/// before it that changes the probabilities: a temperature before it changes the set (it does
/// not commute with [`super::Temperature`]).
#[derive(Clone, Debug)]
pub struct Epsilon {
    epsilon: f64,
    min_keep: usize,
    w: Vec<f32>,
    buf: Vec<Cand>,
}

impl Epsilon {
    /// Epsilon `epsilon`, `min_keep` 1.
    ///
    /// # Errors
    /// [`ParamError`] for `epsilon_cutoff` outside `(0, 1)` (Hugging Face's check).
    pub fn new(epsilon: f64) -> Result<Self, ParamError> {
        if !(epsilon > 0.0 && epsilon < 1.0) {
            return Err(ParamError::new("epsilon_cutoff", epsilon, "(0, 1)"));
        }
        Ok(Self {
            epsilon,
            min_keep: 1,
            w: Vec::new(),
            buf: Vec::new(),
        })
    }

    /// The same filter keeping at least the `min_keep` best tokens.
    ///
    /// # Errors
    /// [`ParamError`] for `min_keep` 0.
    pub fn with_min_keep(mut self, min_keep: usize) -> Result<Self, ParamError> {
        self.min_keep = check_min_keep(min_keep)?;
        Ok(self)
    }

    /// The threshold.
    pub fn epsilon(&self) -> f64 {
        self.epsilon
    }

    /// The number of best tokens never removed.
    pub fn min_keep(&self) -> usize {
        self.min_keep
    }
}

impl LogitsProcessor for Epsilon {
    fn name(&self) -> &str {
        "epsilon"
    }
    fn apply(
        &mut self,
        logits: &mut [f32],
        _ctx: &ProcessorContext<'_>,
    ) -> Result<(), SampleError> {
        // The weights and their sum (no entropy): one fused pass.
        let max = row_max(logits);
        if max == f32::NEG_INFINITY {
            return Ok(());
        }
        let z = super::passes::exp_weights_sum(logits, max, &mut self.w);
        cut_below(
            logits,
            &self.w,
            z,
            self.epsilon,
            self.min_keep,
            &mut self.buf,
        );
        Ok(())
    }
    fn box_clone(&self) -> Box<dyn LogitsProcessor> {
        Box::new(self.clone())
    }
}
