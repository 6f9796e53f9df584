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

// The files: this one holds the API, the checks of a call and the per-row driver
// (`sample_row`: the first pass, then stages 1-3 and 6 in order); `top_p.rs` stage 2 (top-p,
// certified f64 decisions with the exact fallback of `exact.rs`); `cuts.rs` the exact f32
// thresholds (min-p's cut, stage 3); `select.rs` stage 4 (argmax or the exponential race over
// `q`); `passes.rs` the vectorised passes over a row (checks, sums, the weights pass).

mod cuts;
mod exact;
mod passes;
mod select;
mod top_p;

use std::any::TypeId;
use std::cell::RefCell;

use rayon::prelude::*;

use crate::kernels;
use crate::sampler::{self, rank_key, with_widened, Cand};
use crate::view::{InputKind, LogitValue, LogitsView};
use cuts::{ceil_f32, weight_cut};
use passes::first_invalid_probability;
use select::{select_from_list, select_from_row};
use top_p::{top_p_row, top_p_sorted};

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
