//! Choosing among the candidates: top-k candidates by one streaming pass (spec/sampling.md
//! step 9, for the top-n logprobs), the smallest-set top-p prefix (step 10), the f64 mass sums
//! over fixed chunks of [`CHUNK`] ids ("Random streams": chunking independent of threads) and
//! the inverse-CDF selection in token-id order (step 11).

use std::cmp::Ordering;

use super::{better, Cand, CHUNK};

/// [`chunked_sum`] over f64 terms given for ids `0, 1, 2, ...`.
pub(super) fn chunked_sum_f64(items: impl Iterator<Item = f64>) -> f64 {
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

/// The exactly-`k` best tokens (value desc, id asc) among the values above `floor`, into `out`
/// (unordered). Streams the row once: an element enters the buffer only if it beats the
/// current k-th best; a full buffer is cut back to k with a linear-time selection, raising
/// the threshold. Amortised O(1) per element.
pub(super) fn top_k_candidates(logits: &[f32], floor: f32, k: usize, out: &mut Vec<Cand>) {
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
pub(crate) fn top_p_prefix(cand: &mut [Cand], mut target: f64) -> usize {
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

/// The f64 sum of dense weights (weight `i` is token `i`'s): per chunk of [`CHUNK`] ids the
/// vectorised lane sum of `chain/passes.rs` (`sum_weights`: 8 lanes, a fixed structure), the
/// chunk sums in order. Every dense row's `Z` (selection, distribution, logprobs) is this sum.
pub(crate) fn dense_sum(w: &[f32]) -> f64 {
    crate::chain::passes::sum_weights(w)
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
pub(super) fn select_sparse(cand: &[Cand], u: f64) -> (u32, f32, f64, usize) {
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

/// Ids per block of [`select_dense`]'s walk inside a chunk.
const WALK_BLOCK: usize = 256;

/// [`select_sparse`] over dense weights (zero for removed tokens): the same rule, with the
/// chunk sums of [`dense_sum`] and, inside the chosen chunk, the sums of its blocks of
/// [`WALK_BLOCK`] ids (the same token but where `u z` falls within rounding of a chunk or
/// block boundary).
pub(crate) fn select_dense(w: &[f32], u: f64) -> (u32, f32, f64, usize) {
    // The chunk sums of `dense_sum` (vectorised), once each; `z` is their sum in order.
    let parts: Vec<f64> = w.chunks(CHUNK).map(dense_sum).collect();
    let z: f64 = parts.iter().fold(0.0, |a, &p| a + p);
    let target = u * z;
    // Weights are >= 0: the positive ones are those at or above the smallest subnormal.
    let nonzero = crate::chain::passes::count_at_least(w, f32::from_bits(1));
    let mut acc = 0.0f64;
    for (c, (chunk, &part)) in w.chunks(CHUNK).zip(&parts).enumerate() {
        if acc + part > target {
            // Inside the chunk, the same walk over blocks of WALK_BLOCK ids (their vectorised
            // sums), then id by id inside one block: a sequential f64 walk over the whole
            // chunk would be 8,192 dependent additions.
            let mut a = acc;
            for (b, block) in chunk.chunks(WALK_BLOCK).enumerate() {
                let sum = dense_sum(block);
                if a + sum > target {
                    let mut x_acc = a;
                    for (j, &x) in block.iter().enumerate() {
                        x_acc += f64::from(x);
                        if x_acc > target {
                            return ((c * CHUNK + b * WALK_BLOCK + j) as u32, x, z, nonzero);
                        }
                    }
                    // Rounding left the ids one by one at or below the target: go on.
                }
                a += sum;
            }
        }
        acc += part;
    }
    let last = w.iter().rposition(|&x| x > 0.0).unwrap_or(0);
    (last as u32, w[last], z, nonzero)
}
