//! [`top_k_top_p_sample`]: the fused top-k -> top-p -> (min-p) -> exponential-sampling operator
//! with the semantics of Ascend's `torch_npu.npu_top_k_top_p_sample`
//! (spec/npu_top_k_top_p_sample.md in the project's shared folder), on the CPU.
//!
//! Use it to run an engine written against that operator anywhere, or to compare results with
//! the NPU: the caller brings the random numbers `q` (i.i.d. Exp(1) for an exact draw), so the
//! operator itself is deterministic. For nucleus' own sampling path with its own random
//! streams, see [`crate::sample_batch`].
//!
//! # Semantics, per row (spec, "Per row b, stage by stage")
//!
//! The row's tokens are ranked by a stable descending sort of their values: larger value
//! first, ties to the lower id (`-0.0` and `+0.0` tie). Every stage keeps a prefix of that
//! order, so the survivors are the first `n` ranks for some `n >= 1`:
//!
//! 1. **top-k** is on iff `1 <= top_k[b] <= min(V, ks_max)` (`ks_max` above 1024 acts as 1024;
//!    no rounding to a multiple of 8): keep the `top_k[b]` best ranks. Otherwise the stage is
//!    skipped (no error).
//! 2. **top-p** is on iff `0 < top_p[b] < 1`; `top_p[b] >= 1` is off; `top_p[b] <= 0` keeps the
//!    first rank only. On: with `Z` the weight of the stage-1 survivors and `P_i` the weight of
//!    the ranks before `i`, rank `i` is removed iff `P_i > top_p * Z` (the spec's
//!    `cumsum_i - p_i > top_p`, multiplied by `Z`): a prefix whose mass is exactly `top_p`
//!    keeps one more token.
//! 3. **min-p** (only with `min_ps`) is on iff `0 < min_ps[b] < 1`: remove rank `i` iff
//!    `w_i < min_ps[b] * w_0` (`w_0` is the first rank's weight, the maximum); `min_ps[b] >= 1`
//!    keeps the first rank only; `<= 0` is off.
//! 4. **Sample**: without `q`, the argmax of the survivors' probabilities, ties to the lower
//!    id (usually the first rank; not when two different logits have the same f32 weight, e.g.
//!    both `1.0` just below a tiny maximum). With `q`, the survivor with the largest score
//!    `w_i / (q_j + eps)`, ties to the better rank, where `j`
//!    is the token id ([`QIndexing::TokenId`], default) or the survivor's rank
//!    ([`QIndexing::SortedRank`], the op-plugin golden's convention).
//!
//! # Arithmetic: what makes the result exact and reproducible
//!
//! - **Weights.** For logits, `w_i = e^(l_i - max)` computed as [`exp_weight`]: `l_i - max` in
//!   f32, then a fixed f32 polynomial exp (no fused multiply-adds) whose bits are the same on
//!   every instruction set and thread count. It is monotone: checked on every f32 input in
//!   `[-104.5, 0]`, so weights never reorder the ranks. For probabilities
//!   (`InputKind::Probs`), `w_i` is the value itself. "Softmax" is `w_i / Z`.
//! - **Top-p decisions** are made in exact arithmetic on these f32 weights: `P_i > top_p * Z`
//!   as real numbers, with `top_p` read as f32. Exact sums do not depend on the order of
//!   summation, which is what lets a linear-time selection give the same survivors as the
//!   spec's sort. The fast path sums in f64 and accepts a decision only when it is further from
//!   the boundary than a rigorous bound on the f64 rounding (a few `1e-16 * V` relative);
//!   otherwise the row is decided again with exact integer sums (units of `2^-149`).
//! - **min-p** compares `w_i < min_p * w_0` in f64, where the product of two f32 is exact.
//! - **Scores** are `f64(w_i) / (f64(q_j) + eps)`, compared as f64: the spec's
//!   `probs / (q + eps)` times the common factor `Z`, which does not change the exact argmax; a
//!   zero weight scores 0 (also when `q_j + eps` is 0, where `w / 0` would be NaN).
//!
//! # Method (no sort of the row unless [`QIndexing::SortedRank`] asks for ranks)
//!
//! - top-k on: one vectorised pass keeps the exact `k` best in a buffer cut back by a
//!   linear-time selection (the sampler's `scan_top`, which also checks the row); the
//!   `k <= 1024` survivors are sorted (the spec's own `sort(top_k_value)`), then top-p is a
//!   walk over them.
//! - top-p alone on logits: one online pass computes the maximum and an approximate sum of
//!   the weights; if the first rank alone holds more than `top_p` of even an upper bound of
//!   that sum, it is the only survivor (a confident model: no more passes). Otherwise one pass
//!   computes every weight, their f64 sum `Z` and the mass below 4 geometric levels. The last
//!   survivor weighs at least `(1 - top_p) Z / V` (the ranks from it on hold at least
//!   `(1 - top_p) Z` and number at most `V`), and at least any level whose lighter tokens
//!   hold less than `(1 - top_p) Z` (they are the last ranks); only the weights at or above
//!   the highest such bound are collected (a compare pass). A histogram of their mass over
//!   the top bits of the f32 weight (4 buckets per octave, monotone in rank) finds the bucket
//!   holding the boundary, and a quickselect on mass inside it finds the boundary: expected
//!   linear time.
//! - min-p alone: the exact threshold on the logit (a bisection over f32 values of the
//!   monotone weight function), then a compare pass.
//! - `q`: only the survivors' entries are read (and checked).
//! - The spec's rolling top-k over segments of 8 x 1024 elements and its `top_k_guess`
//!   shortcut are strategies of the NPU kernel that never change a result; `top_k_guess` is
//!   accepted and has no effect here.
//!
//! Rows run in parallel on the current rayon pool; a row's result depends only on its own
//! inputs.
//!
//! ```
//! use nucleus_sampling::npu::{top_k_top_p_sample, TopKTopPSampleOptions};
//! use nucleus_sampling::LogitsView;
//!
//! let logits = [1.0f32, 3.0, 2.0, 3.0];
//! let view = LogitsView::dense(&logits, 1, 4).unwrap();
//! let options = TopKTopPSampleOptions { is_need_logits: true, ..Default::default() };
//! let out = top_k_top_p_sample(&view, &[2], &[1.0f32], None, None, &options).unwrap();
//! assert_eq!(out.logits_select_idx, vec![1]);
//! let kept = out.logits_top_kp_select.unwrap();
//! assert_eq!(kept, vec![f32::NEG_INFINITY, 3.0, f32::NEG_INFINITY, 3.0]);
//! assert!(out.row_status[0].is_ok());
//! ```

mod exact;

use std::any::TypeId;
use std::cell::RefCell;

use rayon::prelude::*;

use crate::kernels;
use crate::sampler::{self, rank_key, with_widened, Cand};
use crate::view::{InputKind, LogitValue, LogitsView};
use exact::Exact;

/// The spec's default `eps`.
pub const DEFAULT_EPS: f64 = 1e-8;
/// The spec's default `top_k_guess` (no effect here).
pub const DEFAULT_TOP_K_GUESS: i64 = 32;
/// The spec's default and largest effective `ks_max`.
pub const KS_MAX_LIMIT: i64 = 1024;

/// Which entry of a `q` row scores a survivor (spec step 4).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum QIndexing {
    /// `q[b][token id]`: the seed document's formula. Needs no sort.
    #[default]
    TokenId,
    /// `q[b][r]` for the survivor of rank `r` in the row's stable descending order (ties to
    /// the lower id), as the op-plugin unit-test golden indexes `q`. The survivors are sorted
    /// to know their ranks.
    SortedRank,
}

/// The scalar attributes of [`top_k_top_p_sample`], with the spec's defaults.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct TopKTopPSampleOptions {
    /// Added to `q` before dividing (default [`DEFAULT_EPS`], 1e-8). Finite and `>= 0`.
    pub eps: f64,
    /// Return `logits_top_kp_select` (default false).
    pub is_need_logits: bool,
    /// The NPU kernel's guess of how many tokens top-p keeps (default 32). Accepted for
    /// compatibility; it never changes a result, and this implementation does not use it.
    pub top_k_guess: i64,
    /// The largest `top_k` that turns top-k on (default 1024). At least 1; values above 1024
    /// act as 1024.
    pub ks_max: i64,
    /// How `q` is indexed (default [`QIndexing::TokenId`]).
    pub q_indexing: QIndexing,
}

impl Default for TopKTopPSampleOptions {
    fn default() -> Self {
        Self {
            eps: DEFAULT_EPS,
            is_need_logits: false,
            top_k_guess: DEFAULT_TOP_K_GUESS,
            ks_max: KS_MAX_LIMIT,
            q_indexing: QIndexing::TokenId,
        }
    }
}

/// The outputs of [`top_k_top_p_sample`] for a batch of `B` rows of `V` ids.
#[derive(Clone, Debug, PartialEq)]
pub struct TopKTopPSampleOutput {
    /// `[B]`: the chosen token id of each row; `-1` for a row whose status is an error.
    pub logits_select_idx: Vec<i64>,
    /// `[B, V]` row-major, only when `is_need_logits`: the row's value (as f32) where the token
    /// survived, else `-inf` (logits) or `0` (probabilities). A failed row is all fill values.
    pub logits_top_kp_select: Option<Vec<f32>>,
    /// `[B]`: `Ok` or why the row could not be computed (the NPU operator has no such output).
    pub row_status: Vec<Result<(), TopKTopPRowError>>,
}

/// A whole call of [`top_k_top_p_sample`] is malformed: no row is computed.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
pub enum TopKTopPError {
    /// A per-row input (`top_k`, `top_p`, `min_ps`) does not hold one value per row.
    #[error("`{input}` has {len} values for {batch} logits rows")]
    LengthMismatch {
        /// `"top_k"`, `"top_p"` or `"min_ps"`.
        input: &'static str,
        /// Values given.
        len: usize,
        /// Rows of `logits`.
        batch: usize,
    },
    /// `q` is not `[batch, vocab]` like the logits.
    #[error("`q` has {len} values, but the logits are [{batch}, {vocab}] ({needed} values)")]
    QShape {
        /// Values given.
        len: usize,
        /// Rows of `logits`.
        batch: usize,
        /// Token ids per row.
        vocab: usize,
        /// `batch * vocab`.
        needed: usize,
    },
    /// `top_p` or `min_ps` is neither in the dtype of the logits nor f32.
    #[error("`{input}` is {got}, but must be {}", accepted_dtypes(.logits))]
    DtypeMismatch {
        /// `"top_p"`, or `"top_p and min_ps"` (they share one element type).
        input: &'static str,
        /// Its dtype.
        got: &'static str,
        /// The logits' dtype.
        logits: &'static str,
    },
    /// A scalar attribute is out of range.
    #[error("invalid attribute `{name}` = {value}: allowed {allowed}")]
    InvalidAttribute {
        /// `"eps"` or `"ks_max"`.
        name: &'static str,
        /// The value given, formatted.
        value: String,
        /// The allowed range, in words.
        allowed: &'static str,
    },
}

/// The dtypes `top_p` and `min_ps` may have with logits of dtype `logits`, each named once:
/// `"f32 (the dtype of the logits)"` or `"bf16 (the dtype of the logits) or f32"`.
fn accepted_dtypes(logits: &str) -> String {
    if logits == "f32" {
        "f32 (the dtype of the logits)".to_string()
    } else {
        format!("{logits} (the dtype of the logits) or f32")
    }
}

/// Why one row of [`top_k_top_p_sample`] has no result; the other rows are computed.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
pub enum TopKTopPRowError {
    /// A NaN or +inf logit (`-inf` is legal: it masks).
    #[error("non-finite logit {value:?} at token id {token_id}")]
    NonFiniteLogits {
        /// The lowest such id.
        token_id: u32,
        /// The value there.
        value: f32,
    },
    /// A probability-input row holds a NaN, infinite or negative value.
    #[error("invalid probability {value:?} at token id {token_id}: probabilities must be finite and >= 0")]
    InvalidProbability {
        /// The lowest such id.
        token_id: u32,
        /// The value there.
        value: f32,
    },
    /// Every logit is `-inf` (every probability 0): the softmax is undefined.
    #[error("no candidate token: every logit is -inf (every probability 0)")]
    NoCandidates,
    /// `top_p[b]` is NaN (no stage rule covers it).
    #[error("top_p is NaN")]
    InvalidTopP,
    /// `min_ps[b]` is NaN.
    #[error("min_ps is NaN")]
    InvalidMinP,
    /// A `q` entry that the selection reads (a survivor's) is NaN or negative (q must be
    /// `>= 0`; `+inf` scores 0). Entries of removed tokens are never read.
    #[error("q holds {value:?} at index {index}: q must be >= 0 and not NaN")]
    InvalidQ {
        /// The lowest such index among the entries read, in the row of `q`.
        index: u32,
        /// The value there.
        value: f32,
    },
}

/// The contract's softmax numerator for logits: `e^(logit - max)` with `logit - max` rounded to
/// f32 and a fixed f32 exp (relative error below 4e-7, no fused multiply-adds: the same bits on
/// every machine), 0 below `-104` and for `-inf`. Monotone non-decreasing in `logit` (checked
/// on every f32 argument in `[-104.5, 0]`), and `exp_weight(max, max) = 1`. Probabilities are
/// their own weights. Tests and other implementations use it to reproduce the operator bit for
/// bit.
#[inline]
pub fn exp_weight(logit: f32, max: f32) -> f32 {
    kernels::exp_w(logit - max)
}

/// Samples one token per row with the fused top-k -> top-p -> min-p -> exponential-sampling
/// operator (spec/npu_top_k_top_p_sample.md; the module docs state the arithmetic).
///
/// Arguments (`B` rows, `V = logits.vocab_size()` ids per row):
/// - `logits`: `[B, V]` f32, f16 or bf16 (computation in f32), one per row. Its
///   [`LogitsView::kind`] is the spec's `input_is_logits`: [`InputKind::Logits`] (true, the
///   default) or [`InputKind::Probs`] (false: non-negative weights, renormalised by every
///   stage). A padded view's ids at or above `vocab_size` are ignored.
/// - `top_k`: `[B]` i32, per row; on iff `1 <= k <= min(V, ks_max)`.
/// - `top_p`: `[B]`, per row, in the dtype of the logits or f32; on iff `0 < p < 1`.
/// - `q`: optional `[B, V]` f32 (row-major, dense), per row: the exponential race's divisors,
///   indexed as `options.q_indexing` says. The entries read (the survivors', by id or by rank)
///   must be `>= 0`: a NaN or negative one is a row error; the others are never read. Without
///   `q` each row's result is its argmax.
/// - `min_ps`: optional `[B]`, per row, the same element type as `top_p`; on iff `0 < m < 1`,
///   `m >= 1` keeps the first rank only.
/// - `options`: `eps`, `is_need_logits`, `top_k_guess`, `ks_max`, `q_indexing`, one for all rows.
///
/// Returns `logits_select_idx` `[B]` i64, `logits_top_kp_select` `[B, V]` f32 when
/// `is_need_logits`, and `row_status` `[B]`.
///
/// Randomness: none drawn here; a draw from the renormalised survivors is exact when the
/// caller's `q` entries are i.i.d. Exp(1).
///
/// # Errors
/// [`TopKTopPError`] when `top_k`, `top_p` or `min_ps` do not have `B` values, `q` does not
/// have `B * V`, `top_p` / `min_ps` are in another dtype than the logits' or f32, `eps` is
/// negative or not finite, or `ks_max < 1`. Per-row errors ([`TopKTopPRowError`]: NaN / +inf
/// logits, invalid probabilities, NaN `top_p` / `min_ps`, every token masked, a NaN or
/// negative `q` entry among those read) are in `row_status`, checked in that order.
pub fn top_k_top_p_sample<T: LogitValue, P: LogitValue>(
    logits: &LogitsView<'_, T>,
    top_k: &[i32],
    top_p: &[P],
    q: Option<&[f32]>,
    min_ps: Option<&[P]>,
    options: &TopKTopPSampleOptions,
) -> Result<TopKTopPSampleOutput, TopKTopPError> {
    let batch = logits.batch();
    let vocab = logits.vocab_size();
    for (input, len) in [
        ("top_k", Some(top_k.len())),
        ("top_p", Some(top_p.len())),
        ("min_ps", min_ps.map(<[P]>::len)),
    ] {
        if let Some(len) = len.filter(|&len| len != batch) {
            return Err(TopKTopPError::LengthMismatch { input, len, batch });
        }
    }
    if let Some(q) = q {
        let needed = batch.saturating_mul(vocab);
        if q.len() != needed {
            return Err(TopKTopPError::QShape {
                len: q.len(),
                batch,
                vocab,
                needed,
            });
        }
    }
    if TypeId::of::<P>() != TypeId::of::<T>() && TypeId::of::<P>() != TypeId::of::<f32>() {
        // `top_p` and `min_ps` share one element type.
        let input = if min_ps.is_some() {
            "top_p and min_ps"
        } else {
            "top_p"
        };
        return Err(TopKTopPError::DtypeMismatch {
            input,
            got: dtype_name::<P>(),
            logits: dtype_name::<T>(),
        });
    }
    if !(options.eps.is_finite() && options.eps >= 0.0) {
        return Err(TopKTopPError::InvalidAttribute {
            name: "eps",
            value: options.eps.to_string(),
            allowed: "finite and >= 0",
        });
    }
    if options.ks_max < 1 {
        return Err(TopKTopPError::InvalidAttribute {
            name: "ks_max",
            value: options.ks_max.to_string(),
            allowed: ">= 1 (values above 1024 act as 1024)",
        });
    }
    let probs = logits.kind() == InputKind::Probs;
    let fill = if probs { 0.0 } else { f32::NEG_INFINITY };
    let ctx = Ctx {
        probs,
        eps: options.eps,
        ks_max: options.ks_max.min(KS_MAX_LIMIT) as usize,
        q_indexing: options.q_indexing,
    };
    let row_args = |b: usize| RowArgs {
        top_k: top_k[b],
        top_p: top_p[b].to_f32(),
        min_p: min_ps.map(|m| m[b].to_f32()),
        q: q.map(|q| &q[b * vocab..(b + 1) * vocab]),
    };
    let run = |b: usize, select: Option<&mut [f32]>| -> Result<u32, TopKTopPRowError> {
        let row = logits.row(b);
        match T::as_f32(row) {
            Some(x) => sample_row(x, &row_args(b), &ctx, select),
            None => with_widened(row, |x| sample_row(x, &row_args(b), &ctx, select)),
        }
    };
    let (results, select) = if options.is_need_logits {
        let mut select = vec![fill; batch * vocab];
        let results: Vec<Result<u32, TopKTopPRowError>> = select
            .par_chunks_mut(vocab.max(1))
            .enumerate()
            .map(|(b, out)| run(b, Some(out)))
            .collect();
        (results, Some(select))
    } else {
        let results = (0..batch).into_par_iter().map(|b| run(b, None)).collect();
        (results, None)
    };
    let mut idx = Vec::with_capacity(batch);
    let mut status = Vec::with_capacity(batch);
    for r in results {
        match r {
            Ok(id) => {
                idx.push(i64::from(id));
                status.push(Ok(()));
            }
            Err(e) => {
                idx.push(-1);
                status.push(Err(e));
            }
        }
    }
    Ok(TopKTopPSampleOutput {
        logits_select_idx: idx,
        logits_top_kp_select: select,
        row_status: status,
    })
}

/// `"f32"`, `"f16"`, `"bf16"` (the [`LogitValue`] types).
fn dtype_name<T: 'static>() -> &'static str {
    let t = TypeId::of::<T>();
    if t == TypeId::of::<f32>() {
        "f32"
    } else if t == TypeId::of::<half::f16>() {
        "f16"
    } else if t == TypeId::of::<half::bf16>() {
        "bf16"
    } else {
        "an unknown type"
    }
}

/// Attributes shared by every row.
struct Ctx {
    probs: bool,
    eps: f64,
    /// `min(ks_max, 1024)`.
    ks_max: usize,
    q_indexing: QIndexing,
}

/// One row's parameters.
struct RowArgs<'a> {
    top_k: i32,
    top_p: f32,
    min_p: Option<f32>,
    q: Option<&'a [f32]>,
}

/// Per-thread buffers reused across rows.
#[derive(Default)]
struct Scratch {
    /// Every token's weight (top-p without top-k; sampling every token with `q`).
    weights: Vec<f32>,
    /// The candidates, then the survivors.
    cand: Vec<Cand>,
}

thread_local! {
    static SCRATCH: RefCell<Scratch> = RefCell::new(Scratch::default());
}

fn with_scratch<R>(f: impl FnOnce(&mut Scratch) -> R) -> R {
    SCRATCH.with(|s| match s.try_borrow_mut() {
        Ok(mut s) => f(&mut s),
        Err(_) => f(&mut Scratch::default()),
    })
}

/// Where the survivors are after the filters.
enum Survivors {
    /// `scratch.cand` (any order unless said), with weights.
    List,
    /// Every token of the row.
    All,
}

/// What the first pass over a row found.
struct FirstPass {
    /// The maximum (`-inf` when every value is; for probabilities, 0 when every value is).
    max: f32,
    /// Some value is NaN or +inf.
    bad: bool,
    /// Top-p alone on logits: an approximate `sum exp(l - max)` (the online pass).
    z_approx: Option<f64>,
}

/// One row: checks, stages 1-3, selection, and the `logits_top_kp_select` row.
fn sample_row(
    x: &[f32],
    args: &RowArgs<'_>,
    ctx: &Ctx,
    select: Option<&mut [f32]>,
) -> Result<u32, TopKTopPRowError> {
    let vocab = x.len();
    let probs = ctx.probs;
    let k = args.top_k;
    let k_on = k >= 1 && (k as usize) <= vocab.min(ctx.ks_max);
    let p = args.top_p;
    let p_on = p > 0.0 && p < 1.0;
    let min_p = args.min_p.filter(|&m| m > 0.0 && m < 1.0);
    let first_only = p <= 0.0 || args.min_p.is_some_and(|m| m >= 1.0);

    with_scratch(|scratch| {
        // The first pass finds the maximum and checks the row: for top-k it is the top-k scan
        // itself; for top-p alone on logits, the online max + sum-of-exp pass.
        if probs {
            if let Some(i) = first_invalid_probability(x) {
                return Err(TopKTopPRowError::InvalidProbability {
                    token_id: i as u32,
                    value: x[i],
                });
            }
        }
        let scan_k = k_on && !first_only;
        let first = if scan_k {
            // Stage 1: the exact k best (unordered). Tokens at -inf are left out when fewer
            // than k are finite: weight 0, value -inf = the fill value, never chosen over the
            // maximum, so no output changes.
            let cand = &mut scratch.cand;
            let bad = sampler::scan_top(x, f32::NEG_INFINITY, k as usize, &[], cand, false);
            let max = cand
                .iter()
                .map(|c| c.logit)
                .fold(f32::NEG_INFINITY, f32::max);
            FirstPass {
                max,
                bad,
                z_approx: None,
            }
        } else if p_on && !first_only && !probs {
            let r = kernels::max_sum_exp(x, 1.0);
            FirstPass {
                max: r.max,
                bad: r.bad,
                // Its `l - max` may overflow above 1e30 (see kernels::max_sum_exp).
                z_approx: (r.max <= 1e30).then_some(r.sum),
            }
        } else {
            let (max, bad) = kernels::max_bad(x);
            FirstPass {
                max,
                bad,
                z_approx: None,
            }
        };
        // Checks, in the documented order.
        if first.bad && !probs {
            let i = x
                .iter()
                .position(|&v| v.is_nan() || v == f32::INFINITY)
                .unwrap_or(0);
            return Err(TopKTopPRowError::NonFiniteLogits {
                token_id: i as u32,
                value: x[i],
            });
        }
        if p.is_nan() {
            return Err(TopKTopPRowError::InvalidTopP);
        }
        if args.min_p.is_some_and(f32::is_nan) {
            return Err(TopKTopPRowError::InvalidMinP);
        }
        let max = first.max;
        if max == f32::NEG_INFINITY || (probs && max <= 0.0) || vocab == 0 {
            return Err(TopKTopPRowError::NoCandidates);
        }
        // The first rank: the lowest id holding the maximum.
        let best = if scan_k {
            scratch
                .cand
                .iter()
                .min_by_key(|c| rank_key(c))
                .map_or(0, |c| c.id as usize)
        } else {
            sampler::first_at_least(x, max).unwrap_or(0)
        };
        // Its weight: 1 for logits (exp_weight(max, max)), the maximum for probabilities.
        let w0 = if probs { max } else { 1.0 };
        let best_cand = Cand {
            logit: x[best],
            id: best as u32,
            w: w0,
        };
        let weight = |v: f32| if probs { v } else { exp_weight(v, max) };

        let survivors = if first_only {
            scratch.cand.clear();
            scratch.cand.push(best_cand);
            Survivors::List
        } else if scan_k {
            // Sorted by rank (k <= 1024: the spec's own sort of the top-k values).
            let cand = &mut scratch.cand;
            cand.sort_unstable_by_key(rank_key);
            for c in cand.iter_mut() {
                c.w = weight(c.logit);
            }
            if p_on {
                let n = top_p_sorted(cand, p);
                cand.truncate(n);
            }
            Survivors::List
        } else if p_on {
            top_p_row(x, max, probs, p, best_cand, first.z_approx, scratch);
            Survivors::List
        } else if let Some(m) = min_p {
            // Min-p alone: every token whose weight is at least m * w0, by an exact cut.
            let cut = if probs {
                ceil_f32(f64::from(m) * f64::from(max))
            } else {
                weight_cut(max, m)
            };
            let cand = &mut scratch.cand;
            cand.clear();
            sampler::collect(x, f32::NEG_INFINITY, cut, cand, false);
            for c in cand.iter_mut() {
                c.w = weight(c.logit);
            }
            Survivors::List
        } else {
            Survivors::All
        };
        if let (Survivors::List, Some(m)) = (&survivors, min_p) {
            // Stage 3 (a no-op after the exact cut of min-p alone).
            let threshold = f64::from(m) * f64::from(w0);
            scratch.cand.retain(|c| f64::from(c.w) >= threshold);
        }
        let chosen = match survivors {
            Survivors::List => select_from_list(&mut scratch.cand, args.q, ctx, best as u32)?,
            Survivors::All => select_from_row(x, max, args.q, ctx, best as u32, scratch)?,
        };
        if let Some(out) = select {
            match survivors {
                Survivors::List => {
                    for c in &scratch.cand {
                        out[c.id as usize] = x[c.id as usize];
                    }
                }
                Survivors::All => out.copy_from_slice(x),
            }
        }
        Ok(chosen)
    })
}

/// `u = 2^-53`, the unit roundoff of f64.
const U: f64 = 1.0 / 9_007_199_254_740_992.0;

/// A bound on the rounding error of f64 sums of `n` non-negative terms (any order) and of the
/// few products and differences formed from them, relative to the total: `(n - 1) u` is the
/// classical bound; four times `n + 4` units is generous.
fn sum_error(n: usize) -> f64 {
    4.0 * (n as f64 + 4.0) * U
}

/// Top-p over `cand`, sorted by rank: the number of ranks kept, i.e. the smallest `n` with
/// `P_n > top_p * Z` (`P_n` the weight of the first `n`, `Z` of all), or `cand.len()`.
fn top_p_sorted(cand: &[Cand], p: f32) -> usize {
    let z: f64 = cand.iter().map(|c| f64::from(c.w)).sum();
    top_p_sorted_from(cand, p, z)
}

/// [`top_p_sorted`] given `z`, the f64 sum of the weights (within `sum_error`).
fn top_p_sorted_from(cand: &[Cand], p: f32, z: f64) -> usize {
    let t = f64::from(p) * z;
    let d = sum_error(cand.len()) * z;
    let mut before = 0.0f64;
    for (j, c) in cand.iter().enumerate() {
        let after = before + f64::from(c.w);
        if after > t {
            // Certified when P_j is clearly at or below the target and P_{j+1} clearly above.
            // P_0 = 0 is at or below any target.
            if (j == 0 || before < t - d) && after > t + d {
                return j + 1;
            }
            return top_p_sorted_exact(cand, p);
        }
        before = after;
    }
    // The f64 total did not pass the target (only rounding can do that, as p < 1).
    top_p_sorted_exact(cand, p)
}

/// [`top_p_sorted`] in exact arithmetic.
fn top_p_sorted_exact(cand: &[Cand], p: f32) -> usize {
    let target = Exact::sum(cand.iter().map(|c| c.w)).scale_floor(p);
    let mut acc = Exact::default();
    for (j, c) in cand.iter().enumerate() {
        acc.add_f32(c.w);
        // P is an integer number of units: P > p Z iff P > floor(p Z).
        if acc > target {
            return j + 1;
        }
    }
    cand.len()
}

/// The relative error allowed for `kernels::max_sum_exp`'s sum against the exact sum of
/// [`exp_weight`]s: both exps are within 4e-7 of `e^x`, the kernel's f32 block sums and
/// rescalings add a few 1e-7 more per step; 1e-3 is a wide margin.
const ONLINE_SUM_ERROR: f64 = 1e-3;

/// Top-p without top-k over the whole row: leaves the survivors (any order, with weights) in
/// `scratch.cand`. `z_approx`: the online pass's approximate sum of the weights, if any.
fn top_p_row(
    x: &[f32],
    max: f32,
    probs: bool,
    p: f32,
    best: Cand,
    z_approx: Option<f64>,
    scratch: &mut Scratch,
) {
    let vocab = x.len();
    let cand = &mut scratch.cand;
    cand.clear();
    // The first rank alone holds more than p of the mass, even against an upper bound of the
    // sum: it is the only survivor. Common when the model is confident; no weights pass.
    if let Some(z) = z_approx {
        if f64::from(best.w) > f64::from(p) * z * (1.0 + ONLINE_SUM_ERROR) {
            cand.push(best);
            return;
        }
    }
    // Levels above the cut below, from the approximate sum: the weights pass also adds up the
    // mass below each of them.
    let tail = 1.0 - f64::from(p);
    let levels: Option<[f32; LEVELS]> = z_approx.map(|z| {
        let base = tail * z / vocab as f64;
        std::array::from_fn(|j| (base * 16f64.powi(j as i32 + 1)) as f32)
    });
    let (z, below) = if probs {
        (sum_f64(x), None)
    } else {
        let w = &mut scratch.weights;
        w.resize(vocab, 0.0);
        let (z, below) = weights_and_sum(x, max, w, levels.as_ref());
        (z, levels.zip(below))
    };
    let w_all: &[f32] = if probs { x } else { &scratch.weights };
    // The same with the f64 sum of the exact weights.
    if f64::from(best.w) > f64::from(p) * z + sum_error(2 * vocab) * z {
        cand.push(best);
        return;
    }
    // The last survivor (rank f - 1) weighs at least (1 - p) Z / V: the ranks from it on weigh
    // Z - P_{f-1} >= (1 - p) Z, and there are at most V of them, none heavier. Likewise, if
    // the tokens lighter than a level weigh less than (1 - p) Z, the last survivor is not
    // among them (they are the last ranks). Collect the weights at or above the highest
    // such bound.
    let z_lo = z * (1.0 - sum_error(vocab));
    let eps = tail * z_lo / vocab as f64 * (1.0 - 4.0 * U);
    let mut cut = floor_f32(eps);
    if let Some((levels, below)) = below {
        for (&level, &mass) in levels.iter().zip(&below) {
            if level > cut && mass * (1.0 + LEVEL_SUM_ERROR) < tail * z_lo * (1.0 - 4.0 * U) {
                cut = level;
            }
        }
    }
    sampler::collect(w_all, f32::NEG_INFINITY, cut, cand, false);
    for c in cand.iter_mut() {
        c.w = c.logit;
        c.logit = x[c.id as usize];
    }
    let n = top_p_candidates(cand, p, z, vocab, || Exact::sum(w_all.iter().copied()));
    cand.truncate(n);
}

/// Levels of the weights pass (each 16 times the previous one, from 16 times the
/// `(1 - p) Z / V` bound up).
const LEVELS: usize = 4;

/// The relative error of the mass below a level: f32 sums of at most [`LEVEL_BLOCK`] / 16
/// terms per lane (below 64 * 2^-24 = 4e-6), then f64; 1e-4 is a wide margin.
const LEVEL_SUM_ERROR: f64 = 1e-4;

/// Values per block of the level sums (f32 within a block, f64 across blocks).
const LEVEL_BLOCK: usize = 1024;

/// Top-p over candidates (any order) that hold every survivor of a row of `vocab` tokens
/// whose weights sum to `z` in f64 (within `sum_error(vocab)`), `exact_total` giving the exact
/// sum: rearranges `cand` so that its first `n` entries are the survivors, and returns `n`.
fn top_p_candidates(
    cand: &mut [Cand],
    p: f32,
    z: f64,
    vocab: usize,
    exact_total: impl FnOnce() -> Exact,
) -> usize {
    let t = f64::from(p) * z;
    let f = if cand.len() > BUCKETED_MIN {
        bucketed_prefix(cand, t)
    } else {
        prefix_exceeding(cand, t)
    };
    // Certify with fresh sums: P_{f-1} clearly at or below the target, and P_f clearly above
    // (implied by the cut when every candidate is kept). The last survivor weighs least
    // (weights are monotone in rank).
    let (pf, last_w) = sum_and_min_weight(&cand[..f]);
    let pf1 = pf - f64::from(last_w);
    let d = sum_error(vocab + f) * z;
    // P_0 = 0 is at or below any target.
    let certified = (f == 1 || pf1 < t - d) && (f == cand.len() || pf > t + d);
    if certified {
        return f;
    }
    // Exact: the row's exact total, the candidates in rank order, exact prefix sums.
    let target = exact_total().scale_floor(p);
    cand.sort_unstable_by_key(rank_key);
    let mut acc = Exact::default();
    for (j, c) in cand.iter().enumerate() {
        acc.add_f32(c.w);
        if acc > target {
            return j + 1;
        }
    }
    cand.len()
}

/// Candidate lists longer than this go through [`bucketed_prefix`].
const BUCKETED_MIN: usize = 2048;

/// [`prefix_exceeding`] for long lists: a histogram of the candidates' mass over the top 10
/// bits of their f32 weights (exponent and two mantissa bits: 4 buckets per octave). A larger
/// key means a larger weight, so a better rank (weights are monotone in rank): walking the
/// buckets from the top finds the bucket holding the boundary, and only its candidates go
/// through the quickselect.
fn bucketed_prefix(cand: &mut [Cand], target: f64) -> usize {
    // Without the sign bit: -0.0 (a probability) is the lowest key, like +0.0.
    let key = |c: &Cand| ((c.w.to_bits() & 0x7fff_ffff) >> 21) as usize;
    let (lo, hi) = cand.iter().fold((usize::MAX, 0), |(lo, hi), c| {
        (lo.min(key(c)), hi.max(key(c)))
    });
    let buckets = hi - lo + 1;
    let mut mass = vec![0.0f64; buckets];
    let mut count = vec![0usize; buckets];
    for c in cand.iter() {
        let b = key(c) - lo;
        mass[b] += f64::from(c.w);
        count[b] += 1;
    }
    let mut acc = 0.0f64;
    let mut above = 0usize;
    let mut boundary = None;
    for b in (0..buckets).rev() {
        if acc + mass[b] > target {
            boundary = Some(b);
            break;
        }
        acc += mass[b];
        above += count[b];
    }
    let Some(b) = boundary else {
        return cand.len();
    };
    // The buckets above `b` first, then bucket `b`.
    let kb = lo + b;
    let mut store = 0;
    for j in 0..cand.len() {
        if key(&cand[j]) > kb {
            cand.swap(store, j);
            store += 1;
        }
    }
    debug_assert_eq!(store, above);
    let start = store;
    for j in start..cand.len() {
        if key(&cand[j]) == kb {
            cand.swap(store, j);
            store += 1;
        }
    }
    above + prefix_exceeding(&mut cand[above..store], target - acc)
}

/// The f64 sum (8 lanes) and the smallest weight of `cand`.
fn sum_and_min_weight(cand: &[Cand]) -> (f64, f32) {
    let mut acc = [0.0f64; 8];
    let mut min = f32::INFINITY;
    let chunks = cand.chunks_exact(8);
    let rest = chunks.remainder();
    for ch in chunks {
        for (a, c) in acc.iter_mut().zip(ch) {
            *a += f64::from(c.w);
            min = min.min(c.w);
        }
    }
    for c in rest {
        acc[0] += f64::from(c.w);
        min = min.min(c.w);
    }
    (acc.iter().sum(), if cand.is_empty() { 0.0 } else { min })
}

/// Rearranges `cand` so that `cand[..n]` are its best `n` (rank order) and returns the smallest
/// `n` whose weight (f64) exceeds `target`, or `cand.len()`. Expected linear time: a quickselect
/// on mass with a median-of-three pivot.
fn prefix_exceeding(cand: &mut [Cand], mut target: f64) -> usize {
    let (mut lo, mut hi) = (0usize, cand.len());
    loop {
        if hi - lo <= 32 {
            let part = &mut cand[lo..hi];
            part.sort_unstable_by_key(rank_key);
            let mut acc = 0.0f64;
            for (j, c) in part.iter().enumerate() {
                acc += f64::from(c.w);
                if acc > target {
                    return lo + j + 1;
                }
            }
            return hi;
        }
        let mid = lo + (hi - lo) / 2;
        let pivot_at = median_of_three(cand, lo, mid, hi - 1);
        cand.swap(pivot_at, hi - 1);
        let pivot = cand[hi - 1];
        let pivot_key = rank_key(&pivot);
        let mut store = lo;
        let mut mass = 0.0f64;
        for j in lo..hi - 1 {
            if rank_key(&cand[j]) < pivot_key {
                mass += f64::from(cand[j].w);
                cand.swap(store, j);
                store += 1;
            }
        }
        cand.swap(store, hi - 1);
        // cand[lo..store] ranks before the pivot, now at `store`; cand[store+1..hi] after.
        if mass > target {
            hi = store;
        } else if mass + f64::from(pivot.w) > target {
            return store + 1;
        } else {
            target -= mass + f64::from(pivot.w);
            lo = store + 1;
        }
    }
}

fn median_of_three(c: &[Cand], a: usize, b: usize, d: usize) -> usize {
    let (ka, kb, kd) = (rank_key(&c[a]), rank_key(&c[b]), rank_key(&c[d]));
    if ka < kb {
        if kb < kd {
            b
        } else if ka < kd {
            d
        } else {
            a
        }
    } else if ka < kd {
        a
    } else if kb < kd {
        d
    } else {
        b
    }
}

/// The score of a survivor: `w / (q + eps)` in f64; 0 for a zero weight.
#[inline]
fn score(w: f32, q: f32, eps: f64) -> f64 {
    if w == 0.0 {
        0.0
    } else {
        f64::from(w) / (f64::from(q) + eps)
    }
}

/// The error for `q[index]`, NaN or negative.
fn invalid_q(q: &[f32], index: usize) -> TopKTopPRowError {
    TopKTopPRowError::InvalidQ {
        index: index as u32,
        value: q[index],
    }
}

/// Stage 4 over a survivor list. The `q` entries read (the survivors') must be `>= 0`: the
/// error names the lowest bad index among them.
fn select_from_list(
    cand: &mut [Cand],
    q: Option<&[f32]>,
    ctx: &Ctx,
    best: u32,
) -> Result<u32, TopKTopPRowError> {
    let Some(q) = q else {
        // The argmax of the probabilities, ties to the lower id. Two different logits can have
        // the same f32 weight (both 1.0 just below the maximum), so this is not always the
        // first rank.
        let mut chosen = (f32::NEG_INFINITY, best);
        for c in cand.iter() {
            if c.w > chosen.0 || (c.w == chosen.0 && c.id < chosen.1) {
                chosen = (c.w, c.id);
            }
        }
        return Ok(chosen.1);
    };
    match ctx.q_indexing {
        QIndexing::TokenId => {
            let mut chosen: Option<(f64, u64, u32)> = None;
            let mut bad: Option<u32> = None;
            for c in cand.iter() {
                let qv = q[c.id as usize];
                // NaN or negative.
                if qv.is_nan() || qv < 0.0 {
                    bad = Some(bad.map_or(c.id, |b| b.min(c.id)));
                    continue;
                }
                let s = score(c.w, qv, ctx.eps);
                let key = rank_key(c);
                let wins = match chosen {
                    None => true,
                    Some((bs, bk, _)) => s > bs || (s == bs && key < bk),
                };
                if wins {
                    chosen = Some((s, key, c.id));
                }
            }
            match bad {
                Some(i) => Err(invalid_q(q, i as usize)),
                None => Ok(chosen.map_or(best, |c| c.2)),
            }
        }
        QIndexing::SortedRank => {
            if let Some(i) = first_invalid_q(&q[..cand.len()]) {
                return Err(invalid_q(q, i));
            }
            cand.sort_unstable_by_key(rank_key);
            Ok(argmax_by_rank(
                cand.iter().enumerate().map(|(r, c)| (c, q[r])),
                ctx.eps,
                best,
            ))
        }
    }
}

/// The survivor with the largest score, scanning in rank order (ties: the first).
fn argmax_by_rank<'a>(items: impl Iterator<Item = (&'a Cand, f32)>, eps: f64, best: u32) -> u32 {
    let mut chosen: Option<(f64, u32)> = None;
    for (c, qv) in items {
        let s = score(c.w, qv, eps);
        if chosen.is_none_or(|(bs, _)| s > bs) {
            chosen = Some((s, c.id));
        }
    }
    chosen.map_or(best, |c| c.1)
}

/// Stage 4 when every token survives (every `q` entry is read).
fn select_from_row(
    x: &[f32],
    max: f32,
    q: Option<&[f32]>,
    ctx: &Ctx,
    best: u32,
    scratch: &mut Scratch,
) -> Result<u32, TopKTopPRowError> {
    let Some(q) = q else {
        // The argmax of the probabilities, ties to the lower id: the lowest id whose weight is
        // the maximum's (1 for logits, reached by every logit at or above a cut).
        if ctx.probs {
            return Ok(best);
        }
        let cut = weight_cut(max, 1.0);
        return Ok(sampler::first_at_least(x, cut).map_or(best, |i| i as u32));
    };
    if let Some(i) = first_invalid_q(q) {
        return Err(invalid_q(q, i));
    }
    let w: &[f32] = if ctx.probs {
        x
    } else {
        scratch.weights.resize(x.len(), 0.0);
        weights_and_sum(x, max, &mut scratch.weights, None);
        &scratch.weights
    };
    match ctx.q_indexing {
        QIndexing::TokenId => {
            // Id order: a later token wins a tie only with a strictly larger value.
            let mut chosen = (f64::NEG_INFINITY, f32::NEG_INFINITY, best);
            for (i, ((&wi, &qi), &xi)) in w.iter().zip(q).zip(x).enumerate() {
                let s = score(wi, qi, ctx.eps);
                if s > chosen.0 || (s == chosen.0 && xi > chosen.1) {
                    chosen = (s, xi, i as u32);
                }
            }
            Ok(chosen.2)
        }
        QIndexing::SortedRank => {
            let cand = &mut scratch.cand;
            cand.clear();
            cand.extend(x.iter().zip(w).enumerate().map(|(i, (&l, &wi))| Cand {
                logit: l,
                id: i as u32,
                w: wi,
            }));
            cand.sort_unstable_by_key(rank_key);
            Ok(argmax_by_rank(
                cand.iter().enumerate().map(|(r, c)| (c, q[r])),
                ctx.eps,
                best,
            ))
        }
    }
}

/// The smallest f32 logit whose weight `exp_weight(l, max)` is at least `level` (`0 < level <=
/// 1`), by bisection over the f32 values between `-inf` and `max`: the weight is monotone in
/// the logit, so `l >= cut` is exactly `exp_weight(l, max) >= level` (min-p's rule).
fn weight_cut(max: f32, level: f32) -> f32 {
    // f32 values in ascending order as u32 keys.
    let key = |v: f32| {
        let b = v.to_bits();
        if b & 0x8000_0000 != 0 {
            !b
        } else {
            b | 0x8000_0000
        }
    };
    let value = |k: u32| {
        if k & 0x8000_0000 != 0 {
            f32::from_bits(k & 0x7fff_ffff)
        } else {
            f32::from_bits(!k)
        }
    };
    // exp_weight(-inf) = 0 < level <= exp_weight(max) = 1.
    let (mut lo, mut hi) = (key(f32::NEG_INFINITY), key(max));
    while hi - lo > 1 {
        let mid = lo + (hi - lo) / 2;
        if exp_weight(value(mid), max) >= level {
            hi = mid;
        } else {
            lo = mid;
        }
    }
    value(hi)
}

/// The largest f32 at or below `v` (`v >= 0`).
fn floor_f32(v: f64) -> f32 {
    let f = v as f32;
    if f64::from(f) > v {
        f.next_down()
    } else {
        f
    }
}

/// The smallest f32 at or above `v` (`v >= 0`, within the f32 range).
fn ceil_f32(v: f64) -> f32 {
    let f = v as f32;
    if f64::from(f) < v {
        f.next_up()
    } else {
        f
    }
}

/// The first index whose value is NaN, infinite or negative.
fn first_invalid_probability(x: &[f32]) -> Option<usize> {
    let ok = |v: f32| (0.0..=f32::MAX).contains(&v);
    let all_ok = match kernels::isa() {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `isa()` reports AVX-512F only when the CPU has it.
        kernels::Isa::Avx512 => unsafe { x86::probs_ok_avx512(x) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `isa()` reports AVX2 only when the CPU has it.
        kernels::Isa::Avx2 => unsafe { x86::probs_ok_avx2(x) },
        kernels::Isa::Baseline => all_lanes(x, ok),
    };
    if all_ok {
        None
    } else {
        x.iter().position(|&v| !ok(v))
    }
}

/// The first index of a `q` row whose value is NaN or negative (`-0.0` is fine).
fn first_invalid_q(q: &[f32]) -> Option<usize> {
    let ok = |v: f32| v >= 0.0;
    let all_ok = match kernels::isa() {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `isa()` reports AVX-512F only when the CPU has it.
        kernels::Isa::Avx512 => unsafe { x86::q_ok_avx512(q) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `isa()` reports AVX2 only when the CPU has it.
        kernels::Isa::Avx2 => unsafe { x86::q_ok_avx2(q) },
        kernels::Isa::Baseline => all_lanes(q, ok),
    };
    if all_ok {
        None
    } else {
        q.iter().position(|&v| !ok(v))
    }
}

/// Whether `ok` holds for every value: 16 independent lanes without early exit, which LLVM
/// vectorises.
#[inline(always)]
fn all_lanes(x: &[f32], ok: impl Fn(f32) -> bool) -> bool {
    let mut bad = [0u32; 16];
    let chunks = x.chunks_exact(16);
    let rest = chunks.remainder();
    for c in chunks {
        for (b, &v) in bad.iter_mut().zip(c) {
            *b |= u32::from(!ok(v));
        }
    }
    bad.iter().all(|&b| b == 0) && rest.iter().all(|&v| ok(v))
}

/// The f64 sum of `x` (16 lanes).
fn sum_f64(x: &[f32]) -> f64 {
    match kernels::isa() {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `isa()` reports AVX-512F only when the CPU has it.
        kernels::Isa::Avx512 => unsafe { x86::sum_f64_avx512(x) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `isa()` reports AVX2 only when the CPU has it.
        kernels::Isa::Avx2 => unsafe { x86::sum_f64_avx2(x) },
        kernels::Isa::Baseline => sum_f64_body(x),
    }
}

#[inline(always)]
fn sum_f64_body(x: &[f32]) -> f64 {
    let mut acc = [0.0f64; 16];
    let chunks = x.chunks_exact(16);
    let rest = chunks.remainder();
    for c in chunks {
        for (a, &v) in acc.iter_mut().zip(c) {
            *a += f64::from(v);
        }
    }
    acc.iter().sum::<f64>() + rest.iter().map(|&v| f64::from(v)).sum::<f64>()
}

/// Writes `out[i] = exp_weight(x[i], max)` and returns their f64 sum and, with `levels`, the
/// mass of the weights below each level (within [`LEVEL_SUM_ERROR`]), in vectorised passes
/// (the widest instruction set the CPU has; the weights are the same bits on each).
fn weights_and_sum(
    x: &[f32],
    max: f32,
    out: &mut [f32],
    levels: Option<&[f32; LEVELS]>,
) -> (f64, Option<[f64; LEVELS]>) {
    match kernels::isa() {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `isa()` reports AVX-512F only when the CPU has it.
        kernels::Isa::Avx512 => unsafe { x86::weights_and_sum_avx512(x, max, out, levels) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `isa()` reports AVX2 only when the CPU has it.
        kernels::Isa::Avx2 => unsafe { x86::weights_and_sum_avx2(x, max, out, levels) },
        kernels::Isa::Baseline => weights_and_sum_body(x, max, out, levels),
    }
}

#[inline(always)]
fn weights_and_sum_body(
    x: &[f32],
    max: f32,
    out: &mut [f32],
    levels: Option<&[f32; LEVELS]>,
) -> (f64, Option<[f64; LEVELS]>) {
    // Separate loops for the exp with its stores and for the sums vectorise best.
    let below = match levels {
        None => {
            for (&v, o) in x.iter().zip(out.iter_mut()) {
                *o = kernels::exp_w(v - max);
            }
            None
        }
        Some(levels) => {
            const L: usize = 16;
            let mut below = [0.0f64; LEVELS];
            for (xb, ob) in x.chunks(LEVEL_BLOCK).zip(out.chunks_mut(LEVEL_BLOCK)) {
                let mut part = [[0.0f32; L]; LEVELS];
                let whole = xb.len() / L * L;
                for (xc, oc) in xb[..whole]
                    .chunks_exact(L)
                    .zip(ob[..whole].chunks_exact_mut(L))
                {
                    for i in 0..L {
                        let w = kernels::exp_w(xc[i] - max);
                        oc[i] = w;
                        for j in 0..LEVELS {
                            part[j][i] += if w < levels[j] { w } else { 0.0 };
                        }
                    }
                }
                for (&v, o) in xb[whole..].iter().zip(&mut ob[whole..]) {
                    *o = kernels::exp_w(v - max);
                    for j in 0..LEVELS {
                        part[j][0] += if *o < levels[j] { *o } else { 0.0 };
                    }
                }
                for j in 0..LEVELS {
                    below[j] += part[j].iter().map(|&v| f64::from(v)).sum::<f64>();
                }
            }
            Some(below)
        }
    };
    (sum_f64_body(out), below)
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn sum_f64_avx512(x: &[f32]) -> f64 {
        super::sum_f64_body(x)
    }

    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn sum_f64_avx2(x: &[f32]) -> f64 {
        super::sum_f64_body(x)
    }

    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn probs_ok_avx512(x: &[f32]) -> bool {
        super::all_lanes(x, |v| (0.0..=f32::MAX).contains(&v))
    }

    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn probs_ok_avx2(x: &[f32]) -> bool {
        super::all_lanes(x, |v| (0.0..=f32::MAX).contains(&v))
    }

    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn q_ok_avx512(q: &[f32]) -> bool {
        super::all_lanes(q, |v| v >= 0.0)
    }

    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn q_ok_avx2(q: &[f32]) -> bool {
        super::all_lanes(q, |v| v >= 0.0)
    }

    use super::LEVELS;

    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn weights_and_sum_avx512(
        x: &[f32],
        max: f32,
        out: &mut [f32],
        levels: Option<&[f32; LEVELS]>,
    ) -> (f64, Option<[f64; LEVELS]>) {
        super::weights_and_sum_body(x, max, out, levels)
    }

    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn weights_and_sum_avx2(
        x: &[f32],
        max: f32,
        out: &mut [f32],
        levels: Option<&[f32; LEVELS]>,
    ) -> (f64, Option<[f64; LEVELS]>) {
        super::weights_and_sum_body(x, max, out, levels)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A small deterministic generator for the unit tests.
    fn splitmix(state: &mut u64) -> u64 {
        *state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = *state;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    #[test]
    fn the_certified_top_p_walk_equals_the_exact_one() {
        let mut s = 7u64;
        for case in 0..3000 {
            let n = 1 + (splitmix(&mut s) % 200) as usize;
            let dyadic = case % 3 == 0;
            let mut cand: Vec<Cand> = (0..n)
                .map(|i| {
                    let r = splitmix(&mut s);
                    let w = if dyadic {
                        (r % 8) as f32 / 8.0
                    } else {
                        ((r >> 11) as f64 / 2f64.powi(53)) as f32
                    };
                    Cand {
                        logit: w,
                        id: i as u32,
                        w,
                    }
                })
                .collect();
            cand[0].w = 1.0;
            cand[0].logit = 1.0;
            cand.sort_unstable_by_key(rank_key);
            let p = if dyadic {
                (1 + splitmix(&mut s) % 15) as f32 / 16.0
            } else {
                ((splitmix(&mut s) >> 11) as f64 / 2f64.powi(53)) as f32
            };
            if !(p > 0.0 && p < 1.0) {
                continue;
            }
            assert_eq!(
                top_p_sorted(&cand, p),
                top_p_sorted_exact(&cand, p),
                "case {case}"
            );
        }
    }

    #[test]
    fn an_f64_total_off_by_rounding_at_an_exact_tie_falls_back_to_exact_sums() {
        // Uniform 1/8 (dyadic): the mass before rank 4 is exactly p Z for p = 0.5. An f64
        // total a few ulps off either way (what rounding could do on other data) must not move
        // the boundary: the certification rejects it and the exact sums decide.
        let cand: Vec<Cand> = (0..8)
            .map(|i| Cand {
                logit: 0.125,
                id: i,
                w: 0.125,
            })
            .collect();
        for z in [1.0f64, 1.0 + 4.0 * U, 1.0 - 4.0 * U, 1.0 + 64.0 * U] {
            assert_eq!(top_p_sorted_from(&cand, 0.5, z), 5, "z {z}");
            let mut c = cand.clone();
            assert_eq!(
                top_p_candidates(&mut c, 0.5, z, 8, || Exact::sum(cand.iter().map(|c| c.w))),
                5,
                "z {z}"
            );
            let mut ids: Vec<u32> = c[..5].iter().map(|c| c.id).collect();
            ids.sort_unstable();
            assert_eq!(ids, vec![0, 1, 2, 3, 4]);
        }
        // Without the certification, the perturbed totals would move it.
        let t_hi = 0.5 * (1.0 + 64.0 * U);
        assert!((0.5..0.625).contains(&t_hi));
        let mut c = cand.clone();
        assert_eq!(prefix_exceeding(&mut c, 0.5 * (1.0 - 4.0 * U)), 4);
    }

    #[test]
    fn the_bucketed_prefix_is_the_sorted_prefix() {
        let mut s = 23u64;
        for case in 0..300 {
            let n = 1 + (splitmix(&mut s) % 6000) as usize;
            let kind = case % 3;
            let mut cand: Vec<Cand> = (0..n)
                .map(|i| {
                    let r = splitmix(&mut s);
                    // Logits and monotone weights: a few levels (ties), a spread, zeros.
                    let l = match kind {
                        0 => (r % 7) as f32 - 6.0,
                        1 => ((r >> 11) as f64 / 2f64.powi(53) * -30.0) as f32,
                        _ if r.is_multiple_of(5) => -200.0,
                        _ => (r % 3000) as f32 * -0.04,
                    };
                    // A probability row's -0.0 sits with the zeros (weights stay monotone).
                    let w = if l == -200.0 && i % 2 == 0 {
                        -0.0
                    } else {
                        exp_weight(l, 0.0)
                    };
                    Cand {
                        logit: l,
                        id: i as u32,
                        w,
                    }
                })
                .collect();
            let total: f64 = cand.iter().map(|c| f64::from(c.w)).sum();
            let target = total * ((splitmix(&mut s) % 33) as f64 / 32.0);
            let mut sorted = cand.clone();
            sorted.sort_unstable_by_key(rank_key);
            let (mut acc, mut before) = (0.0, 0.0);
            let mut want = n;
            for (j, c) in sorted.iter().enumerate() {
                before = acc;
                acc += f64::from(c.w);
                if acc > target {
                    want = j + 1;
                    break;
                }
            }
            let got = bucketed_prefix(&mut cand, target);
            // The f64 sums add in other orders: equal unless the target is within rounding.
            let near = (acc - target).abs().min((before - target).abs()) <= 1e-9 * total;
            if !near {
                assert_eq!(got, want, "case {case}");
                let mut prefix: Vec<u32> = cand[..got].iter().map(|c| c.id).collect();
                let mut want_ids: Vec<u32> = sorted[..want].iter().map(|c| c.id).collect();
                prefix.sort_unstable();
                want_ids.sort_unstable();
                assert_eq!(prefix, want_ids, "case {case}");
            }
        }
    }

    #[test]
    fn the_quickselect_prefix_is_the_sorted_prefix() {
        let mut s = 11u64;
        for case in 0..2000 {
            let n = 1 + (splitmix(&mut s) % 300) as usize;
            let mut cand: Vec<Cand> = (0..n)
                .map(|i| {
                    let l = (splitmix(&mut s) % 20) as f32;
                    Cand {
                        logit: l,
                        id: i as u32,
                        w: l / 8.0,
                    }
                })
                .collect();
            let total: f64 = cand.iter().map(|c| f64::from(c.w)).sum();
            let target = total * ((splitmix(&mut s) % 17) as f64 / 16.0);
            let mut sorted = cand.clone();
            sorted.sort_unstable_by_key(rank_key);
            let mut acc = 0.0;
            let mut want = n;
            for (j, c) in sorted.iter().enumerate() {
                acc += f64::from(c.w);
                if acc > target {
                    want = j + 1;
                    break;
                }
            }
            let got = prefix_exceeding(&mut cand, target);
            assert_eq!(got, want, "case {case}");
            let mut prefix: Vec<u32> = cand[..got].iter().map(|c| c.id).collect();
            let mut want_ids: Vec<u32> = sorted[..want].iter().map(|c| c.id).collect();
            prefix.sort_unstable();
            want_ids.sort_unstable();
            assert_eq!(prefix, want_ids, "case {case}");
        }
    }

    #[test]
    fn the_weight_cut_is_the_exact_threshold() {
        for (max, m) in [
            (0.0f32, 0.5f32),
            (3.0, 0.05),
            (-7.5, 1e-30),
            (1e30, 0.999_999),
            (-1e30, 0.3),
            (5.0, 1e-45),
            (1e-10, 1.0),
            (7.0, 1.0),
        ] {
            let cut = weight_cut(max, m);
            assert!(exp_weight(cut, max) >= m, "{max} {m}");
            assert!(exp_weight(cut.next_down(), max) < m, "{max} {m}");
        }
    }

    #[test]
    fn weights_and_sum_gives_exp_weight_bits_on_every_path() {
        let x: Vec<f32> = (0..3037)
            .map(|i| ((i * 7919) % 1009) as f32 * -0.03)
            .chain([f32::NEG_INFINITY, 0.0])
            .collect();
        let levels: [f32; LEVELS] = std::array::from_fn(|j| 1e-6 * 4f32.powi(j as i32 + 1));
        for lv in [None, Some(&levels)] {
            let mut out = vec![0.0; x.len()];
            let mut base = vec![0.0; x.len()];
            let (z, below) = weights_and_sum(&x, 0.0, &mut out, lv);
            let (zb, below_b) = weights_and_sum_body(&x, 0.0, &mut base, lv);
            for (i, &v) in x.iter().enumerate() {
                assert_eq!(out[i].to_bits(), exp_weight(v, 0.0).to_bits(), "{i}");
                assert_eq!(base[i].to_bits(), out[i].to_bits(), "{i}");
            }
            let want: f64 = out.iter().map(|&w| f64::from(w)).sum();
            assert!((z - want).abs() <= 1e-12 * want && (zb - want).abs() <= 1e-12 * want);
            assert_eq!(below.is_some(), lv.is_some());
            if let (Some(below), Some(below_b)) = (below, below_b) {
                for j in 0..LEVELS {
                    let want: f64 = out
                        .iter()
                        .filter(|&&w| w < levels[j])
                        .map(|&w| f64::from(w))
                        .sum();
                    for got in [below[j], below_b[j]] {
                        assert!((got - want).abs() <= LEVEL_SUM_ERROR * want, "level {j}");
                    }
                    assert!(want > 0.0 && want < z, "level {j} is exercised");
                }
            }
        }
    }

    #[test]
    fn float_rounding_helpers_round_the_right_way() {
        for v in [0.1f64, 1.0, 1e-46, 3.0e38, 0.0, 2.5e-40] {
            assert!(f64::from(floor_f32(v)) <= v && f64::from(floor_f32(v).next_up()) > v);
            assert!(f64::from(ceil_f32(v)) >= v && f64::from(ceil_f32(v).next_down()) < v);
        }
    }
}
