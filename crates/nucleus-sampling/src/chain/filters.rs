//! Filters (spec/sampling.md steps 8-10): processors that keep a subset of the candidates.

use super::{better, row_max, LogitsProcessor, ProcessorContext};
use crate::error::{ParamError, SampleError};
use crate::sampler::chunked_sum;

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
