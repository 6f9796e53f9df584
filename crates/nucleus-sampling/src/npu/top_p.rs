//! Stage 2 of spec/npu_top_k_top_p_sample.md ("Per row b, stage by stage"), top-p: rank `i`
//! is removed iff `P_i > top_p * Z`, decided in exact arithmetic on the f32 weights. The f64
//! sums are accepted only when they are further from the boundary than a bound on their
//! rounding ([`sum_error`]); otherwise the exact sums of [`Exact`] decide. Two cases: the
//! sorted top-k survivors ([`top_p_sorted`]), and the whole row ([`top_p_row`]: a cut from the
//! total mass and the weights pass's levels, then a histogram of the candidates' mass and a
//! quickselect on mass inside the boundary's bucket).

use super::cuts::floor_f32;
use super::exact::Exact;
use super::passes::{sum_f64, weights_and_sum, LEVELS, LEVEL_SUM_ERROR};
use super::Scratch;
use crate::sampler::{self, rank_key, Cand};

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
pub(super) fn top_p_sorted(cand: &[Cand], p: f32) -> usize {
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
/// [`exp_weight`](super::exp_weight)s: both exps are within 4e-7 of `e^x`, the kernel's f32
/// block sums and rescalings add a few 1e-7 more per step; 1e-3 is a wide margin.
const ONLINE_SUM_ERROR: f64 = 1e-3;

/// Top-p without top-k over the whole row: leaves the survivors (any order, with weights) in
/// `scratch.cand`. `z_approx`: the online pass's approximate sum of the weights, if any.
pub(super) fn top_p_row(
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::npu::exp_weight;

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
}
