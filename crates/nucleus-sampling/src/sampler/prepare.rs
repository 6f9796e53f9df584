//! The row pass of the fast path: spec/sampling.md steps 1 and 3-10 in order for one row
//! (checks, constraints / bias / penalties, greedy, temperature, min-p, top-k, top-p), leaving
//! the survivors and their weights in the per-thread [`Scratch`] for selection (step 11). The
//! steps are in the files of their stage ([`super::check`], [`super::modify`],
//! [`super::select`]) and the passes over the row in [`super::scan`]; this file decides which
//! passes a request needs and in which order.

use std::cell::RefCell;

use super::check::{check_request, non_finite};
use super::modify::{
    apply_constraints_bias_penalties, apply_sparse_modifications, list_modified_ids,
    merge_modifications, modifies_logits,
};
use super::scan::{collect, first_at_least, row_exp_pass, row_max_sum_exp, scan_top, scan_window};
use super::select::{dense_sum, top_p_prefix};
use super::{better, rank_key, Cand, SampleRequest, LIST_FRACTION, SPLIT_MIN};
use crate::error::SampleError;
use crate::kernels;
use crate::view::InputKind;

/// Per-thread buffers, reused across rows so the hot path does not allocate once warm.
#[derive(Default)]
pub(super) struct Scratch {
    /// The penalised copy of the row (only when a penalty applies).
    pub(super) logits: Vec<f32>,
    /// Candidates of top-k / top-p; after `prepare`, `cand[..n]` is the survivor list.
    pub(super) cand: Vec<Cand>,
    /// Dense weights, zero for removed tokens (when the survivors are not a short list).
    pub(super) weights: Vec<f32>,
    /// Bitset of ids already penalised (distinct ids count once).
    pub(super) seen: Vec<u64>,
    /// Occurrence counts of output ids (frequency penalty); all zero between rows.
    pub(super) counts: Vec<u32>,
    /// Bitset marking ids while the sparse modification list is built; all zero between rows.
    pub(super) mark: Vec<u64>,
    /// Candidate logits and weights, gathered for the vectorised exp.
    pub(super) cand_w: Vec<f32>,
    /// Ids that steps 3-5 may change (sparse mode), in first-seen order.
    pub(super) mod_ids: Vec<u32>,
    /// Their values after steps 3-5.
    pub(super) mod_vals: Vec<f32>,
    /// Id -> index in `mod_ids` (sparse mode), an open-addressing table.
    pub(super) slot_table: Vec<u64>,
}

thread_local! {
    static SCRATCH: RefCell<Scratch> = RefCell::new(Scratch::default());
}

pub(super) fn with_scratch<T>(f: impl FnOnce(&mut Scratch) -> T) -> T {
    SCRATCH.with(|s| match s.try_borrow_mut() {
        Ok(mut scratch) => f(&mut scratch),
        // Re-entrant use (not expected): fall back to fresh buffers rather than panic.
        Err(_) => f(&mut Scratch::default()),
    })
}

/// Where the final distribution lives after [`prepare`].
pub(super) enum Support {
    /// One token with probability 1.
    Greedy(u32),
    /// `scratch.cand[..n]`, sorted by id, with weights.
    List(usize),
    /// `scratch.weights[..vocab]`, zero for removed tokens.
    Dense,
}

pub(super) struct Prepared {
    pub(super) support: Support,
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
pub(super) fn prepare(
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
    check_request(row, kind, request)?;
    let probs = kind == InputKind::Probs;
    // The value that masks a token: -inf for logits, 0 for probabilities.
    let floor = if probs { 0.0 } else { f32::NEG_INFINITY };
    let vocab = row.len();

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
                dense_sum(w)
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
        // Many candidates (a flat row: no token holds much, the boundary lies in the bulk):
        // a search on the dense weights instead of a list of most of the row.
        if weights_ready || count_at_least(logits, cut) > DENSE_TOP_P_MIN {
            if !weights_ready {
                let w = dense_weights(&mut scratch.weights, vocab);
                if row_exp_pass(logits, max, t, w, split) {
                    for (wi, &l) in w.iter_mut().zip(logits) {
                        *wi = weight(l);
                    }
                }
            }
            let w = dense_weights(&mut scratch.weights, vocab);
            let z = if weights_ready { z } else { dense_sum(w) };
            top_p_dense(logits, w, weight(max), params.top_p, z, cand);
            return Ok(Prepared {
                support: Support::Dense,
            });
        }
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

/// Top-p candidate counts above which [`top_p_dense`] replaces the candidate list.
const DENSE_TOP_P_MIN: usize = 16_384;

/// A bracket of the boundary weight holding at most this many tokens is searched by
/// [`top_p_prefix`].
const BRACKET_MAX: usize = 1024;

/// The number of logits `>= cut` (NaN counts: it is checked before).
fn count_at_least(logits: &[f32], cut: f32) -> usize {
    crate::chain::passes::count_at_least(logits, cut)
}

/// Top-p (step 10) over dense weights: `w` holds every token's weight (`w_max` the
/// maximum's, `z` their [`dense_sum`]); zeroes the weights of the tokens outside the shortest
/// prefix, in the (logit desc, id asc) order, whose mass reaches `p z`. `cand` is scratch.
///
/// The boundary token's weight lies in a bracket `(lo, hi]`: at first `lo` just below
/// `(1 - p) z / vocab` (the last survivor weighs at least that, see the caller) and `hi =
/// w_max`. Each [`crate::chain::passes::mass_above_levels`] pass (one read of the weights)
/// gives the mass above three levels (the first pass: at the quarters of the bracket in
/// log-weight; later ones: around where the target falls if the mass is linear in
/// log-weight between `lo` and `hi`, a sixteenth of the bracket apart): a level whose mass
/// clearly reaches `p z` (beyond the passes' rounding bound) becomes `lo`, one whose mass
/// clearly falls short becomes `hi`. When the bracket holds at most
/// [`BRACKET_MAX`] tokens (or stops narrowing) its tokens are collected, and
/// [`top_p_prefix`] finds the boundary among them with the f64 mass above `hi` taken off the
/// target. Every token above `hi` survives, those in the bracket after the boundary and
/// those at or below `lo` do not. Cost: the exp pass the caller made, about three reads of
/// the weights on a flat row, and a short list.
fn top_p_dense(logits: &[f32], w: &mut [f32], w_max: f32, p: f64, z: f64, cand: &mut Vec<Cand>) {
    use crate::chain::passes::{
        collect_weights_between, mass_above, mass_above_levels, zero_weights_below, MASS_LEVELS,
        MASS_LEVEL_ERROR,
    };
    let vocab = w.len();
    let target = p * z;
    let eps = (1.0 - p) * z / vocab as f64 * (1.0 - 1e-6);
    // Rounded down (0 when it underflows: probabilities can be that small), below `w_max`.
    let mut lo = {
        let e = eps as f32;
        let e = if f64::from(e) > eps { e.next_down() } else { e };
        e.max(0.0).min(w_max.next_down())
    };
    let mut hi = w_max;
    let (mut count_lo, mut count_hi) = (vocab as u64, 0u64);
    // The masses above `lo` and `hi` (above `lo` at most `z`).
    let (mut mass_lo, mut mass_hi) = (z, 0.0f64);
    for pass in 0..12 {
        if count_lo - count_hi <= BRACKET_MAX as u64 {
            break;
        }
        // Where the target falls if the mass is linear in log-weight between `lo` and `hi`;
        // the levels around it (the first pass: at the quarters).
        // Geometric levels need a positive bottom: the smallest subnormal for 0.
        let (a, b) = (
            f64::from(lo.max(f32::from_bits(1))).ln(),
            f64::from(hi).ln(),
        );
        let f = ((mass_lo - target) / (mass_lo - mass_hi)).clamp(0.0, 1.0);
        let at = |x: f64| (x.exp() as f32).clamp(lo, hi);
        let levels: [f32; MASS_LEVELS] = if pass == 0 {
            std::array::from_fn(|j| at(a + (b - a) * (j + 1) as f64 / (MASS_LEVELS + 1) as f64))
        } else {
            let c = a + f * (b - a);
            let d = (b - a) / 16.0;
            std::array::from_fn(|j| at(c + d * (j as f64 - (MASS_LEVELS / 2) as f64)))
        };
        let (mass, count) = mass_above_levels(w, &levels);
        let (before_lo, before_hi) = (lo, hi);
        for j in 0..MASS_LEVELS {
            if mass[j] >= target * (1.0 + MASS_LEVEL_ERROR) && levels[j] > lo {
                lo = levels[j];
                count_lo = count[j];
                mass_lo = mass[j];
            }
        }
        for j in (0..MASS_LEVELS).rev() {
            if mass[j] < target * (1.0 - MASS_LEVEL_ERROR) && levels[j] < hi && levels[j] >= lo {
                hi = levels[j];
                count_hi = count[j];
                mass_hi = mass[j];
            }
        }
        if (lo, hi) == (before_lo, before_hi) {
            break;
        }
    }
    cand.clear();
    collect_weights_between(w, logits, lo, hi, cand);
    let above = mass_above(w, hi);
    let n = if above >= target {
        // Rounding only (the passes said the mass above `hi` falls short): nothing more.
        0
    } else {
        top_p_prefix(cand, target - above)
    };
    for c in &cand[n..] {
        w[c.id as usize] = 0.0;
    }
    zero_weights_below(w, f64::from(lo.next_up()));
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

/// A logit at or below every `l` with `(l - max) / T >= level` (`level <= 0`, in f64 with a
/// relative margin far above f32 rounding): a cut for [`collect`], followed by an exact test
/// where exactness matters.
pub(crate) fn logit_cut(max: f32, level: f64, t64: f64) -> f32 {
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
