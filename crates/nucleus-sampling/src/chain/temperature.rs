//! Temperature and entropy (spec/sampling.md step 7 and the catalogue's entropy-based
//! processors): [`Temperature`], [`DynamicTemperature`], [`Typical`], [`Eta`], [`TopH`] and
//! [`LogSoftmax`].
//!
//! Every probability here is the softmax of the row's finite logits (the anchors'
//! "candidates"; a removed token is `-inf`): weights `w = exp(l - max)` in f32, their sum `z`
//! in f64 over fixed id chunks (as [`super::TopP`] and the chain's selection), decisions in
//! f64. The entropy, in nats, is `H = ln z - sum(w (l - max)) / z`: the same as
//! `-sum(p ln p)` with `ln p` the exact log-softmax `(l - max) - ln z`, and a token whose f32
//! weight is 0 adds nothing (Hugging Face's `nansum`; llama.cpp's `p > 0` guard).

use super::filters::{check_min_keep, cut_below};
use super::{better, row_max, LogitsProcessor, ProcessorContext};
use crate::error::{ParamError, SampleError};
use crate::params::GREEDY_TEMPERATURE;
use crate::sampler::Cand;

/// Temperature: `l = l / T` in f32, a pure division, as Hugging Face's
/// `TemperatureLogitsWarper.__call__` (`scores / self.temperature`), llama.cpp's
/// `llama_sampler_temp_impl` and vLLM's `Sampler.apply_temperature` compute it: the output is
/// the logits a later processor of the anchors would see, so a `repetition_penalty` placed
/// after it sees the signs of the scaled logits (issue 16: logits [1, 2, 3], token 0 seen,
/// temperature 1 then repetition penalty 2 gives p0 = 0.0566, as Hugging Face does). The shift
/// by the row maximum that keeps `exp` from overflowing belongs to the softmax, where it changes
/// nothing; the fixed `SamplingParams` path (spec/sampling.md step 7) still divides after
/// subtracting the maximum, which gives the same distribution because every step after it is
/// shift-invariant. `-inf` stays `-inf`. Stateless.
///
/// Place in the chain: its result depends on it. Before a penalty it changes what the penalty
/// does (the sign of `l` decides `l / r` or `l * r`); before min-p, top-k or top-p it changes the
/// probabilities they see (top-k's set does not change; min-p's and top-p's do).
///
/// For greedy decoding (T below 1e-5) use [`super::Selection::Greedy`].
#[derive(Clone, Debug, PartialEq)]
pub struct Temperature {
    t: f64,
    /// [`Self::after_max_subtraction`]'s form.
    shifted: bool,
}

impl Temperature {
    /// Temperature `t`.
    ///
    /// # Errors
    /// [`ParamError`] for `temperature` unless `t` is finite and `>= 1e-5`
    /// ([`GREEDY_TEMPERATURE`]); below it the fixed path is greedy, which here is the
    /// [`super::Selection::Greedy`] step.
    pub fn new(t: f64) -> Result<Self, ParamError> {
        if !(t >= GREEDY_TEMPERATURE && t.is_finite()) {
            return Err(ParamError::new(
                "temperature",
                t,
                "a finite number >= 1e-5 (for lower temperatures use the greedy selection)",
            ));
        }
        Ok(Self { t, shifted: false })
    }

    /// The fixed `SamplingParams` path's form (spec/sampling.md step 7): `l = (l - max) / T` in
    /// f32, the row maximum subtracted first so that no finite `T` can overflow; afterwards the
    /// maximum is 0. The distribution is the same as [`Self::new`]'s; the logits are not (every
    /// one is `<= 0`), so a logit-sign-dependent processor after it (a repetition penalty) acts
    /// differently. [`super::SamplerChain::from_params`] uses it, because there every later step
    /// is shift-invariant and this form rounds as the fast path does.
    ///
    /// # Errors
    /// As [`Self::new`].
    pub fn after_max_subtraction(t: f64) -> Result<Self, ParamError> {
        Ok(Self {
            shifted: true,
            ..Self::new(t)?
        })
    }

    /// The temperature.
    pub fn t(&self) -> f64 {
        self.t
    }
}

/// `logits[i] /= t` in f32 for every finite logit.
///
/// # Errors
/// [`SampleError::ProcessorOverflow`] naming `processor` and the lowest id whose quotient left
/// the f32 range (`|l| / T > f32::MAX`); the row is then left unchanged.
pub(crate) fn divide(
    logits: &mut [f32],
    t: f32,
    processor: &'static str,
) -> Result<(), SampleError> {
    // |l / t| can only overflow where |l| > f32::MAX * t (never for t >= 1).
    let limit = f32::MAX * t;
    if t < 1.0 && super::passes::any_abs_above(logits, limit) {
        if let Some((i, &l)) = logits
            .iter()
            .enumerate()
            .find(|(_, l)| l.is_finite() && l.abs() > limit && !(*l / t).is_finite())
        {
            return Err(SampleError::ProcessorOverflow {
                processor,
                token_id: i as u32,
                logit: l,
            });
        }
    }
    // `-inf` stays `-inf`, also for `t = inf` (where `-inf / inf` would be NaN).
    super::passes::divide_finite(logits, t);
    Ok(())
}

impl LogitsProcessor for Temperature {
    fn name(&self) -> &str {
        "temperature"
    }
    /// # Errors
    /// [`SampleError::ProcessorOverflow`] when `l / T` leaves the f32 range.
    fn apply(
        &mut self,
        logits: &mut [f32],
        _ctx: &ProcessorContext<'_>,
    ) -> Result<(), SampleError> {
        if !self.shifted {
            return divide(logits, self.t as f32, "temperature");
        }
        let max = row_max(logits);
        if max == f32::NEG_INFINITY {
            return Ok(());
        }
        let t = self.t as f32;
        if super::passes::shift_divide(logits, max, t) {
            return Ok(());
        }
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

// ---------------------------------------------------------------------------------------------
// Softmax statistics
// ---------------------------------------------------------------------------------------------

/// The softmax statistics of a row's finite logits ([`weigh`]).
#[derive(Clone, Copy, Debug)]
pub(crate) struct Weights {
    /// The largest logit.
    pub max: f32,
    /// The number of finite logits (at least 1).
    pub count: usize,
    /// `z = sum(w)`, `w = exp(l - max)` in f32, summed in f64 over fixed id chunks.
    pub z: f64,
    /// `sum(w (l - max))` in f64 (`l - max` in f32), over the tokens with `w > 0`.
    pub s: f64,
}

impl Weights {
    /// The entropy in nats, `ln z - s / z` (0 for one candidate).
    pub fn entropy(&self) -> f64 {
        self.z.ln() - self.s / self.z
    }

    /// The expected logit `sum(p l) = max + s / z`.
    pub fn mean_logit(&self) -> f64 {
        f64::from(self.max) + self.s / self.z
    }
}

/// Writes the weights `w[i] = exp(l[i] - max)` (f32; 0 for `-inf`) into `w` (resized to the
/// row) and returns their statistics; `None` when every logit is `-inf`. A max pass, the
/// dispatched exp pass, a pass for the sums and a count (`chain/passes.rs`).
pub(crate) fn weigh(logits: &[f32], w: &mut Vec<f32>) -> Option<Weights> {
    let max = row_max(logits);
    if max == f32::NEG_INFINITY {
        return None;
    }
    let super::passes::ExpStats { z, s, count } = super::passes::exp_stats(logits, max, w);
    Some(Weights { max, count, z, s })
}

// ---------------------------------------------------------------------------------------------
// Radix selection
// ---------------------------------------------------------------------------------------------

/// Buckets of the first level (over the row).
const FIRST_BUCKETS: usize = 4096;
/// Buckets of each further level (over one group).
const BUCKETS: usize = 2048;
/// Further levels at most; each narrows a group's key range by about [`BUCKETS`], so 64-bit
/// keys are down to one value after six.
const LEVELS: usize = 8;
/// Groups at most this large are sorted instead of split further.
const SORT_BELOW: usize = 64;

#[derive(Clone, Copy, Debug)]
struct Entry {
    key: u64,
    id: u32,
    w: f32,
}

/// A selection in the order (key ascending, id ascending) over a row's finite logits, with
/// a running weight: the first token at which the running sum of the weights exceeds a
/// target and the rank reaches a minimum. Exact and O(vocab) in the worst case: a histogram
/// over the row of a first digit of the key (monotone in the key, [`FIRST_BUCKETS`] values)
/// finds the group that holds the answer; each further level splits that group into
/// [`BUCKETS`] equal ranges of its own keys (so far outliers cost nothing) until it is at most
/// [`SORT_BELOW`] long or of one key, and the rest is sorted. The weight sums are per group,
/// in id order within a group, so the running sum differs from a sum in sorted order by
/// rounding only; where that rounding keeps a group's walk from passing the target, its last
/// token is the answer (the group sum decided). Buffers are kept across calls.
#[derive(Clone, Debug, Default)]
struct RadixSelect {
    mass: Vec<f64>,
    cnt: Vec<u32>,
    /// A second first-level histogram (odd ids), so that runs of one bucket do not chain.
    mass_odd: Vec<f64>,
    cnt_odd: Vec<u32>,
    /// Each token's first digit ([`NO_DIGIT`] for `-inf`), for the gather and the caller.
    digits: Vec<u16>,
    /// The ids whose first digit is the cut's group, ascending.
    group_ids: Vec<u32>,
    a: Vec<Entry>,
    b: Vec<Entry>,
}

/// The first digit of a `-inf` token.
const NO_DIGIT: u16 = u16::MAX;

/// Where [`RadixSelect::select`] cut: the last kept token's key and id, and its first digit.
/// A token is kept iff its first digit is below `group`, or equal and (key, id) <= (`key`,
/// `id`).
#[derive(Clone, Copy, Debug)]
struct Cut {
    key: u64,
    id: u32,
    group: u16,
}

/// The first bucket whose group makes `acc > target && kept >= min_rank` true at its end
/// (`Ok`), else the last non-empty bucket (`Err`); `acc` and `kept` are advanced over the
/// groups before the one returned. `None`: every bucket is empty.
fn pick(
    mass: &[f64],
    cnt: &[u32],
    acc: &mut f64,
    kept: &mut usize,
    target: f64,
    min_rank: usize,
) -> Option<Result<usize, usize>> {
    let mut last = None;
    for (d, (&m, &c)) in mass.iter().zip(cnt).enumerate() {
        if c == 0 {
            continue;
        }
        let c = c as usize;
        if *acc + m > target && *kept + c >= min_rank {
            return Some(Ok(d));
        }
        last = Some((d, *acc, *kept));
        *acc += m;
        *kept += c;
    }
    let (d, a, k) = last?;
    (*acc, *kept) = (a, k);
    Some(Err(d))
}

impl RadixSelect {
    fn clear_hist(&mut self, len: usize) {
        self.mass.clear();
        self.mass.resize(len, 0.0);
        self.cnt.clear();
        self.cnt.resize(len, 0);
    }

    /// Over the finite logits of `logits` in the order (`key(l)`, id), the first token at
    /// which the running sum of `weight(id)` exceeds `target` and whose rank (1-based) is at
    /// least `min_rank`; `None` when no token is (everything is kept). `first(key)` is below
    /// [`FIRST_BUCKETS`] and never decreases as the key grows (its value for `-inf` is
    /// ignored). Afterwards `self.digits` holds every token's first digit and, with a cut,
    /// `self.group_ids` the ids of its group.
    fn select(
        &mut self,
        logits: &[f32],
        key: impl Fn(f32) -> u64,
        first: impl Fn(u64) -> usize,
        weight: impl Fn(usize) -> f32,
        target: f64,
        min_rank: usize,
    ) -> Option<Cut> {
        self.clear_hist(FIRST_BUCKETS);
        self.mass_odd.clear();
        self.mass_odd.resize(FIRST_BUCKETS, 0.0);
        self.cnt_odd.clear();
        self.cnt_odd.resize(FIRST_BUCKETS, 0);
        self.digits.resize(logits.len(), NO_DIGIT);
        // The digits first (a pass that vectorises), then the two histograms from them.
        for (d, &l) in self.digits.iter_mut().zip(logits) {
            let f = first(key(l)) as u16;
            *d = if l == f32::NEG_INFINITY { NO_DIGIT } else { f };
        }
        let n = logits.len();
        for i in (0..n).step_by(2) {
            let d = self.digits[i];
            if d != NO_DIGIT {
                self.mass[d as usize] += f64::from(weight(i));
                self.cnt[d as usize] += 1;
            }
            if i + 1 < n {
                let d = self.digits[i + 1];
                if d != NO_DIGIT {
                    self.mass_odd[d as usize] += f64::from(weight(i + 1));
                    self.cnt_odd[d as usize] += 1;
                }
            }
        }
        for ((m, c), (mo, co)) in self
            .mass
            .iter_mut()
            .zip(self.cnt.iter_mut())
            .zip(self.mass_odd.iter().zip(&self.cnt_odd))
        {
            *m += mo;
            *c += co;
        }
        let (mut acc, mut kept) = (0.0f64, 0usize);
        let Some(Ok(group)) = pick(&self.mass, &self.cnt, &mut acc, &mut kept, target, min_rank)
        else {
            return None;
        };
        let group = group as u16;
        self.a.clear();
        self.group_ids.clear();
        const SCAN: usize = 64;
        for (c, ds) in self.digits.chunks(SCAN).enumerate() {
            // Most chunks hold no token of the group: an or-reduction (vectorised) skips them.
            if !ds.iter().fold(false, |any, &d| any | (d == group)) {
                continue;
            }
            for (j, &d) in ds.iter().enumerate() {
                if d == group {
                    let i = c * SCAN + j;
                    self.group_ids.push(i as u32);
                    self.a.push(Entry {
                        key: key(logits[i]),
                        id: i as u32,
                        w: weight(i),
                    });
                }
            }
        }
        // The group holds the answer; each level narrows it. Groups stay in id order.
        for _ in 0..LEVELS {
            if self.a.len() <= SORT_BELOW {
                break;
            }
            let (lo, hi) = self
                .a
                .iter()
                .fold((u64::MAX, 0), |(lo, hi), e| (lo.min(e.key), hi.max(e.key)));
            if lo == hi {
                break;
            }
            // `lo` maps to bucket 0 and `hi` to at least BUCKETS / 2: the group always splits.
            let scale = BUCKETS as f64 / ((hi - lo) as f64 + 1.0);
            let bucket = |k: u64| (((k - lo) as f64 * scale) as usize).min(BUCKETS - 1);
            self.clear_hist(BUCKETS);
            for e in &self.a {
                let d = bucket(e.key);
                self.mass[d] += f64::from(e.w);
                self.cnt[d] += 1;
            }
            let (Ok(d) | Err(d)) =
                pick(&self.mass, &self.cnt, &mut acc, &mut kept, target, min_rank)
                    .expect("the group is not empty");
            self.b.clear();
            self.b
                .extend(self.a.iter().filter(|e| bucket(e.key) == d).copied());
            std::mem::swap(&mut self.a, &mut self.b);
        }
        self.a.sort_unstable_by_key(|e| (e.key, e.id));
        let cut = |e: &Entry| Cut {
            key: e.key,
            id: e.id,
            group,
        };
        for e in &self.a {
            acc += f64::from(e.w);
            kept += 1;
            if acc > target && kept >= min_rank {
                return Some(cut(e));
            }
        }
        // Rounding between the group sums and the sums in order: the group's last token.
        self.a.last().map(cut)
    }
}

/// A finite logit as a key that orders like (logit descending): the f32 total order's bits
/// reversed, in the top half of a u64. `-0.0` and `0.0` give the same key.
fn descending_key(l: f32) -> u64 {
    let b = (l + 0.0).to_bits();
    let ascending = if b >> 31 == 1 { !b } else { b | 0x8000_0000 };
    u64::from(!ascending) << 32
}

// ---------------------------------------------------------------------------------------------
// Dynamic temperature
// ---------------------------------------------------------------------------------------------

/// Dynamic temperature ("entropy sampling"): a temperature chosen per row from the normalised
/// entropy of its distribution (llama.cpp `src/llama-sampler.cpp`,
/// `llama_sampler_temp_ext_apply`, `temp_ext` with `delta` our `range`). With `range > 0`
/// and at least two finite logits:
/// `T = lo + (hi - lo) * (H / ln n)^exponent` with `lo = max(0, t - range)`, `hi = t + range`,
/// `H` the entropy of the softmax of the `n` finite logits (llama.cpp's candidates), all in
/// f64; then the logits are divided by `T` in f32, a pure division as [`Temperature`]. A
/// uniform row (`H = ln n`) gets `hi`, a one-hot row (`H = 0`) `lo` (for `exponent > 0`;
/// `0^0 = 1`). When `T` comes out 0 (in f32), llama.cpp's `llama_sampler_temp_impl` for
/// `temp <= 0` applies: only the largest logit stays (the lowest id among ties), the others
/// become `-inf`. With at most one finite logit the row is unchanged (llama.cpp returns early).
/// With `range <= 0` it is the plain temperature `t` (`l / t`). `-inf` stays `-inf`. Stateless;
/// a max pass, an exp pass and the division pass, buffers kept across calls.
///
/// Place in the chain: its temperature depends on the probabilities it sees (a filter before
/// it lowers `n` and the entropy), and it changes the probabilities every later processor sees.
#[derive(Clone, Debug)]
pub struct DynamicTemperature {
    t: f64,
    range: f64,
    exponent: f64,
    w: Vec<f32>,
}

impl DynamicTemperature {
    /// Temperature `t`, range `range` and exponent `exponent` (llama.cpp's defaults: range 0,
    /// exponent 1).
    ///
    /// # Errors
    /// [`ParamError`] for
    /// - `dynatemp_range` NaN or infinite;
    /// - `dynatemp_exponent` NaN, infinite or negative;
    /// - `temperature`: with `range <= 0` as [`Temperature::new`] (finite, `>= 1e-5`); with
    ///   `range > 0` finite and `>= 0`; and `t + range` must be finite in f32.
    pub fn new(t: f64, range: f64, exponent: f64) -> Result<Self, ParamError> {
        if !range.is_finite() {
            return Err(ParamError::new(
                "dynatemp_range",
                range,
                "a finite number (<= 0 disables it)",
            ));
        }
        if !(exponent.is_finite() && exponent >= 0.0) {
            return Err(ParamError::new(
                "dynatemp_exponent",
                exponent,
                "a finite number >= 0",
            ));
        }
        if range <= 0.0 {
            Temperature::new(t)?;
        } else if !(t.is_finite() && t >= 0.0) {
            return Err(ParamError::new(
                "temperature",
                t,
                "a finite number >= 0 (the centre of the dynamic range)",
            ));
        } else if !((t + range) as f32).is_finite() {
            return Err(ParamError::new(
                "dynatemp_range",
                range,
                "temperature + range within the f32 range",
            ));
        }
        Ok(Self {
            t,
            range,
            exponent,
            w: Vec::new(),
        })
    }

    /// The centre temperature.
    pub fn t(&self) -> f64 {
        self.t
    }

    /// The half-width of the range (`<= 0`: plain temperature).
    pub fn range(&self) -> f64 {
        self.range
    }

    /// The exponent of the entropy mapping.
    pub fn exponent(&self) -> f64 {
        self.exponent
    }

    /// The temperature this row gets: `None` when the row is left unchanged (range on and at
    /// most one finite logit).
    fn temperature_for(&mut self, logits: &[f32]) -> Option<f64> {
        if self.range <= 0.0 {
            return Some(self.t);
        }
        let stats = weigh(logits, &mut self.w)?;
        if stats.count <= 1 {
            return None;
        }
        let normalised = stats.entropy() / (stats.count as f64).ln();
        let lo = (self.t - self.range).max(0.0);
        let hi = self.t + self.range;
        Some(lo + (hi - lo) * normalised.powf(self.exponent))
    }
}

impl LogitsProcessor for DynamicTemperature {
    fn name(&self) -> &str {
        "dynatemp"
    }
    /// # Errors
    /// [`SampleError::ProcessorOverflow`] when `l / T` leaves the f32 range (a tiny `T`).
    fn apply(
        &mut self,
        logits: &mut [f32],
        _ctx: &ProcessorContext<'_>,
    ) -> Result<(), SampleError> {
        let Some(t) = self.temperature_for(logits) else {
            return Ok(());
        };
        let t = t as f32;
        if t > 0.0 {
            return divide(logits, t, "dynatemp");
        }
        let max = row_max(logits);
        let Some(best) = logits.iter().position(|&l| l == max) else {
            return Ok(());
        };
        for (i, l) in logits.iter_mut().enumerate() {
            if i != best {
                *l = f32::NEG_INFINITY;
            }
        }
        Ok(())
    }
    fn box_clone(&self) -> Box<dyn LogitsProcessor> {
        Box::new(self.clone())
    }
}

// ---------------------------------------------------------------------------------------------
// Typical
// ---------------------------------------------------------------------------------------------

/// Locally typical sampling: keeps the tokens whose surprisal `-ln p` is closest to the
/// entropy `H`, the shortest such prefix whose mass exceeds `p` (Meister et al. 2022; llama.cpp
/// `src/llama-sampler.cpp`, `llama_sampler_typical_apply`, the anchor). The order is the
/// shifted score `|-ln p - H|` ascending, ties to the lower id; since
/// `-ln p_i - H = E[l] - l_i`, the score is `|l_i - E[l]|`, the distance of the logit from
/// the expected logit `E[l] = max + sum(w (l - max)) / z`, computed in f64. The prefix stops
/// at the first token where the running mass is `> p` strictly and at least `min_keep` tokens
/// are in, as llama.cpp (`cum_sum > p && i >= min_keep - 1`); if rounding never lets it pass
/// `p`, everything is kept. Hugging Face's `TypicalLogitsWarper` differs: it stops where the
/// running mass reaches `p` (`>=`: at an exact hit it keeps one token fewer) and keeps every
/// token tied in score with the last one; llama.cpp is followed. The mass is compared as
/// `sum(w) > p * z` in f64. 1 is off (llama.cpp's `p >= 1` early return); at most one finite
/// logit leaves the row unchanged. Stateless.
///
/// Cost: O(vocab), no allocation once warm: a max pass and the vectorised exp pass, a pass
/// computing each token's first digit of its score (the score's f32
/// exponent and top 4 mantissa bits: 16 buckets per binade), a histogram pass over those
/// digits, a gather of the one group that holds the cut (chunks without it are skipped), a
/// few passes over that group (split into 2,048 equal score ranges per level, sorted when at
/// most 64 long), and a mask pass on the digits. Measured at about 10x a max + sum-of-exp
/// pass over a 151,936-long row (BENCHMARKS.md, "Chain processors"): the order statistic's
/// digit, histogram and gather passes dominate (a histogram does not vectorise). llama.cpp
/// sorts the whole row instead.
///
/// Place in the chain: it depends on the probabilities it sees (a temperature before it moves
/// `E[l]` and the masses).
#[derive(Clone, Debug)]
pub struct Typical {
    p: f64,
    min_keep: usize,
    w: Vec<f32>,
    select: RadixSelect,
}

impl Typical {
    /// Typical-p `p`, `min_keep` 1.
    ///
    /// # Errors
    /// [`ParamError`] for `typical_p` outside `(0, 1]`.
    pub fn new(p: f64) -> Result<Self, ParamError> {
        if !(p > 0.0 && p <= 1.0) {
            return Err(ParamError::new("typical_p", p, "(0, 1] (1 disables it)"));
        }
        Ok(Self {
            p,
            min_keep: 1,
            w: Vec::new(),
            select: RadixSelect::default(),
        })
    }

    /// The same filter keeping at least `min_keep` tokens (the most typical).
    ///
    /// # Errors
    /// [`ParamError`] for `min_keep` 0.
    pub fn with_min_keep(mut self, min_keep: usize) -> Result<Self, ParamError> {
        self.min_keep = check_min_keep(min_keep)?;
        Ok(self)
    }

    /// The mass to pass.
    pub fn p(&self) -> f64 {
        self.p
    }

    /// The number of tokens never removed.
    pub fn min_keep(&self) -> usize {
        self.min_keep
    }
}

impl LogitsProcessor for Typical {
    fn name(&self) -> &str {
        "typical"
    }
    fn apply(
        &mut self,
        logits: &mut [f32],
        _ctx: &ProcessorContext<'_>,
    ) -> Result<(), SampleError> {
        if self.p >= 1.0 {
            return Ok(());
        }
        let Some(stats) = weigh(logits, &mut self.w) else {
            return Ok(());
        };
        if stats.count <= 1 {
            return Ok(());
        }
        let mean = stats.mean_logit();
        let key = |l: f32| (f64::from(l) - mean).abs().to_bits();
        let w = &self.w;
        // First digit: the score's f32 bits above bit 19 (8 exponent, 4 mantissa bits).
        let first = |k: u64| ((f64::from_bits(k) as f32).to_bits() >> 19) as usize;
        let cut = self.select.select(
            logits,
            key,
            first,
            |i| w[i],
            self.p * stats.z,
            self.min_keep,
        );
        let Some(cut) = cut else {
            return Ok(());
        };
        // Above the cut's group: removed (NO_DIGIT, -inf, stays -inf); in it: by (key, id).
        for (l, &d) in logits.iter_mut().zip(&self.select.digits) {
            *l = if d > cut.group { f32::NEG_INFINITY } else { *l };
        }
        for &i in &self.select.group_ids {
            let k = key(logits[i as usize]);
            if k > cut.key || (k == cut.key && i > cut.id) {
                logits[i as usize] = f32::NEG_INFINITY;
            }
        }
        Ok(())
    }
    fn box_clone(&self) -> Box<dyn LogitsProcessor> {
        Box::new(self.clone())
    }
}

// ---------------------------------------------------------------------------------------------
// Eta
// ---------------------------------------------------------------------------------------------

/// Eta sampling: epsilon sampling with an entropy-dependent threshold
/// `eta = min(epsilon, sqrt(epsilon) * exp(-H))` (Hewitt et al. 2022; Hugging Face
/// `src/transformers/generation/logits_process.py`, `EtaLogitsWarper`, whose code computes
/// `torch.min(epsilon, torch.sqrt(epsilon) * torch.exp(-entropy))`, as the paper; its
/// docstring's `sqrt(epsilon * e^-entropy)` is a typo, not followed). Tokens with probability
/// below `eta` are removed, at least `min_keep` kept, as [`super::Epsilon`] (same
/// probabilities, f64 decision, ties to the lower id). `H` is the entropy of the softmax of
/// the finite logits in nats. Stateless; a max pass, an exp pass (the bottleneck) and a mask
/// pass, buffers kept across calls.
///
/// Place in the chain: it depends on the probabilities it sees (a temperature before it
/// changes both the entropy and the probabilities).
#[derive(Clone, Debug)]
pub struct Eta {
    epsilon: f64,
    min_keep: usize,
    w: Vec<f32>,
    buf: Vec<Cand>,
}

impl Eta {
    /// Eta with `epsilon`, `min_keep` 1.
    ///
    /// # Errors
    /// [`ParamError`] for `eta_cutoff` outside `(0, 1)` (Hugging Face's check).
    pub fn new(epsilon: f64) -> Result<Self, ParamError> {
        if !(epsilon > 0.0 && epsilon < 1.0) {
            return Err(ParamError::new("eta_cutoff", epsilon, "(0, 1)"));
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

    /// `epsilon`.
    pub fn epsilon(&self) -> f64 {
        self.epsilon
    }

    /// The number of best tokens never removed.
    pub fn min_keep(&self) -> usize {
        self.min_keep
    }
}

impl LogitsProcessor for Eta {
    fn name(&self) -> &str {
        "eta"
    }
    fn apply(
        &mut self,
        logits: &mut [f32],
        _ctx: &ProcessorContext<'_>,
    ) -> Result<(), SampleError> {
        let Some(stats) = weigh(logits, &mut self.w) else {
            return Ok(());
        };
        let eta = self
            .epsilon
            .min(self.epsilon.sqrt() * (-stats.entropy()).exp());
        cut_below(logits, &self.w, stats.z, eta, self.min_keep, &mut self.buf);
        Ok(())
    }
    fn box_clone(&self) -> Box<dyn LogitsProcessor> {
        Box::new(self.clone())
    }
}

// ---------------------------------------------------------------------------------------------
// Top-h
// ---------------------------------------------------------------------------------------------

/// The number of most likely tokens [`TopH`] considers (Hugging Face's `self.top_n = 100`).
const TOP_H_CANDIDATES: usize = 100;

/// Top-h: among the 100 most likely tokens, the longest prefix whose cumulative entropy stays
/// within `top_h` times their entropy (Potraghloo et al. 2025, "Top-H Decoding"; Hugging Face
/// `src/transformers/generation/logits_process.py`, `TopHLogitsWarper`, followed exactly:
/// the stored copy has it). The candidates are the `N = min(100, n)` best finite logits
/// (logit descending, ties to the lower id; `torch.topk`); `q` is their own softmax
/// (renormalised over the `N`), `tau = top_h * H(q)`, and the tokens are kept in order while
/// `C_k = sum_{j <= k} -q_j ln q_j <= tau` (`<=`: an exact hit stays), the first always; every
/// other token is removed. `-q ln q` is formed as `q ((l_0 - l_j) + ln z_N)` in f64. A token
/// whose f32 weight `exp(l_j - l_0)` is 0 ends the prefix (Hugging Face: `0 * log 0` is NaN,
/// which fails `<= tau`). Stateless.
///
/// Cost: O(vocab), no allocation once warm: a digit pass (the logit's sign, exponent and top
/// 3 mantissa bits), a histogram pass and a gather find the group of the 100th best (narrowed
/// further when it is large), a pass collects the 100, which are sorted, and a mask pass; no
/// exp over the row. Measured at about 12x a max + sum-of-exp pass over a 151,936-long row
/// (BENCHMARKS.md, "Chain processors"): the order statistic's digit, histogram and gather
/// passes dominate (a histogram does not vectorise).
///
/// Place in the chain: it depends on the logits it sees (a temperature before it changes `q`).
#[derive(Clone, Debug)]
pub struct TopH {
    top_h: f64,
    select: RadixSelect,
    top: Vec<(f32, u32)>,
}

impl TopH {
    /// Top-h `top_h`.
    ///
    /// # Errors
    /// [`ParamError`] for `top_h` outside `(0, 1]` (Hugging Face's check).
    pub fn new(top_h: f64) -> Result<Self, ParamError> {
        if !(top_h > 0.0 && top_h <= 1.0) {
            return Err(ParamError::new("top_h", top_h, "(0, 1]"));
        }
        Ok(Self {
            top_h,
            select: RadixSelect::default(),
            top: Vec::new(),
        })
    }

    /// The entropy fraction.
    pub fn top_h(&self) -> f64 {
        self.top_h
    }
}

impl LogitsProcessor for TopH {
    fn name(&self) -> &str {
        "top_h"
    }
    fn apply(
        &mut self,
        logits: &mut [f32],
        _ctx: &ProcessorContext<'_>,
    ) -> Result<(), SampleError> {
        let count = super::passes::count_finite(logits);
        if count <= 1 {
            return Ok(());
        }
        let n = TOP_H_CANDIDATES.min(count);
        self.top.clear();
        if n == count {
            self.top.extend(
                logits
                    .iter()
                    .enumerate()
                    .filter(|(_, &l)| l != f32::NEG_INFINITY)
                    .map(|(i, &l)| (l + 0.0, i as u32)),
            );
        } else {
            let cut = self
                .select
                .select(
                    logits,
                    descending_key,
                    |k| (k >> 52) as usize,
                    |_| 0.0,
                    f64::NEG_INFINITY,
                    n,
                )
                .expect("n <= count finite logits");
            let (nk, nid) = (cut.key, cut.id);
            self.top.extend(
                logits
                    .iter()
                    .enumerate()
                    .filter(|&(i, &l)| {
                        l != f32::NEG_INFINITY && {
                            let k = descending_key(l);
                            k < nk || (k == nk && i as u32 <= nid)
                        }
                    })
                    .map(|(i, &l)| (l + 0.0, i as u32)),
            );
        }
        self.top.sort_unstable_by(better);
        let l0 = self.top[0].0;
        let (mut z, mut s) = (0.0f64, 0.0f64);
        for &(l, _) in &self.top {
            let d = l - l0;
            let w = crate::kernels::exp_w(d);
            z += f64::from(w);
            if w > 0.0 {
                s += f64::from(w) * f64::from(d);
            }
        }
        let ln_z = z.ln();
        let tau = self.top_h * (ln_z - s / z);
        let mut keep = 1;
        let mut cumulative = 0.0f64;
        for (j, &(l, _)) in self.top.iter().enumerate() {
            let d = l - l0;
            let w = crate::kernels::exp_w(d);
            if w == 0.0 {
                break;
            }
            let q = f64::from(w) / z;
            cumulative += q * (ln_z - f64::from(d));
            if j > 0 && cumulative > tau {
                break;
            }
            keep = j + 1;
        }
        let (kl, kid) = self.top[keep - 1];
        super::passes::mask_ranked_after(logits, kl, kid);
        Ok(())
    }
    fn box_clone(&self) -> Box<dyn LogitsProcessor> {
        Box::new(self.clone())
    }
}

// ---------------------------------------------------------------------------------------------
// Log-softmax
// ---------------------------------------------------------------------------------------------

/// Log-softmax: `l = l - logsumexp(l)` over the finite logits, so that the row holds the
/// log-probabilities (Hugging Face `src/transformers/generation/logits_process.py`,
/// `LogitNormalization`, `scores.log_softmax(dim=-1)`, which `renormalize_logits=True` appends
/// after the other processors). `logsumexp = max + ln z`, `z = sum(exp(l - max))` with f32
/// weights summed in f64 (fixed id chunks); `l - logsumexp` in f64, stored as f32. `-inf`
/// stays `-inf`; a row of `-inf` is unchanged. Stateless; a max pass, an exp pass, a write
/// pass, no allocation.
///
/// Place in the chain: the distribution is unchanged (a shift), but the logits are not: a
/// logit-sign-dependent processor after it (a repetition penalty) sees every logit `<= 0`,
/// and a second log-softmax changes nothing but rounding.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct LogSoftmax;

impl LogSoftmax {
    /// Log-softmax.
    pub fn new() -> Self {
        Self
    }
}

impl LogitsProcessor for LogSoftmax {
    fn name(&self) -> &str {
        "log_softmax"
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
        let z = super::passes::sum_exp(logits, max);
        let lse = f64::from(max) + z.ln();
        super::passes::subtract_f64(logits, lse);
        Ok(())
    }
    fn box_clone(&self) -> Box<dyn LogitsProcessor> {
        Box::new(self.clone())
    }
}
