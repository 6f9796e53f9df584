//! Stage 4 of spec/npu_top_k_top_p_sample.md ("Per row b, stage by stage"), sampling: without
//! `q`, the argmax of the survivors' probabilities (ties to the lower id); with `q`, the
//! survivor with the largest score `w_i / (q_j + eps)`, `q` indexed by token id or by sorted
//! rank ([`QIndexing`]). Only the `q` entries read are checked.

use super::cuts::weight_cut;
use super::passes::{first_invalid_q, weights_and_sum};
use super::{Ctx, QIndexing, Scratch, TopKTopPRowError};
use crate::sampler::{self, rank_key, Cand};

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
pub(super) fn select_from_list(
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
pub(super) fn select_from_row(
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
