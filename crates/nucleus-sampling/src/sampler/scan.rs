//! The vectorised passes over a whole row that the fast path is built from (spec/sampling.md
//! steps 1 and 6-10 find their candidates with them): [`scan_top`] (the exact best `keep`,
//! for greedy and top-k), [`scan_window`] (min-p's window below the running maximum),
//! [`collect`] (every value at or above a cut, for min-p and top-p), [`first_at_least`], and
//! the max / sum-of-exp and exp passes of [`crate::kernels`] over the row. Each pass also
//! reports NaN / +inf (step 1). AVX-512, AVX2 or SSE2 is chosen at run time (module `x86`
//! holds the `target_feature` bodies; the results are the same bits). Long rows are split
//! across the rayon pool by whole chunks of [`CHUNK`] ids and merged in chunk order.

use std::cell::Cell;

use rayon::prelude::*;

use super::{key_logit, piece, rank_key, rank_key_of, Cand, CHUNK};
use crate::kernels;

/// [`kernels::max_sum_exp`] over the row, chunk by chunk across the pool when `split`
/// (folded in chunk order: the same bits).
pub(super) fn row_max_sum_exp(logits: &[f32], t: f32, split: bool) -> kernels::MaxSumExp {
    if split {
        let parts: Vec<Vec<kernels::MaxSumExp>> = logits
            .par_chunks(piece(logits.len()))
            .map(|part| {
                part.chunks(CHUNK)
                    .map(|chunk| kernels::max_sum_exp(chunk, t))
                    .collect()
            })
            .collect();
        kernels::max_sum_exp_fold(parts.into_iter().flatten(), t)
    } else {
        kernels::max_sum_exp(logits, t)
    }
}

/// [`kernels::exp_pass`] over the row (chunks across the pool when `split`); returns whether
/// the caller must redo it exactly (`l - max` may have overflowed).
pub(super) fn row_exp_pass(logits: &[f32], max: f32, t: f32, out: &mut [f32], split: bool) -> bool {
    if split {
        logits
            .par_chunks(piece(logits.len()))
            .zip(out.par_chunks_mut(piece(logits.len())))
            .map(|(part, o)| kernels::exp_pass(part, max, t, o).overflow)
            .reduce(|| false, |a, b| a | b)
    } else {
        kernels::exp_pass(logits, max, t, out).overflow
    }
}

/// The exactly-`keep` best tokens (value desc, id asc) among the values above `floor` whose
/// ids are not set in the bitset `exclude` (empty: none excluded), into `out` (unordered), in
/// one vectorised pass that also reports whether any value is NaN or +inf. `keep >= 1`.
pub(crate) fn scan_top(
    logits: &[f32],
    floor: f32,
    keep: usize,
    exclude: &[u64],
    out: &mut Vec<Cand>,
    split: bool,
) -> bool {
    if split {
        // The first chunk alone; its `keep`-th best value is a lower bound of the row's (an
        // element of a later chunk, so of a higher id, must beat it strictly), which lets every
        // other chunk, in parallel, skip nearly everything. Then the best `keep` of all the
        // chunks' candidates: a set that does not depend on the split (a buffer per chunk:
        // the split path allocates).
        let first = logits.len().min(CHUNK);
        out.clear();
        let mut bad = scan_top(&logits[..first], floor, keep, exclude, out, false);
        let start = match out.iter().max_by_key(|c| rank_key(c)) {
            Some(worst) if out.len() == keep => worst.logit,
            _ => floor,
        };
        let size = piece(logits.len() - first);
        let parts: Vec<(Vec<Cand>, bool)> = logits[first..]
            .par_chunks(size)
            .enumerate()
            .map(|(c, part)| {
                let offset = first + c * size;
                let exclude = if exclude.is_empty() {
                    exclude
                } else {
                    &exclude[offset / 64..]
                };
                let mut v = Vec::new();
                let bad = scan_top(part, start, keep, exclude, &mut v, false);
                for cand in &mut v {
                    cand.id += offset as u32;
                }
                (v, bad)
            })
            .collect();
        for (v, b) in parts {
            out.extend_from_slice(&v);
            bad |= b;
        }
        if out.len() > keep {
            compact(out, keep);
        }
        return bad;
    }
    match kernels::isa() {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `isa()` reports AVX-512F only when the CPU has it.
        kernels::Isa::Avx512 => unsafe { x86::scan_top_avx512(logits, floor, keep, exclude, out) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `isa()` reports AVX2 only when the CPU has it.
        kernels::Isa::Avx2 => unsafe { x86::scan_top_avx2(logits, floor, keep, exclude, out) },
        kernels::Isa::Baseline => scan_top_body::<SSE2>(logits, floor, keep, exclude, out),
    }
}

/// Every token above `floor` whose value is at or above `cut(running maximum)`, into `out`
/// in id order, in one vectorised pass; returns whether any value is NaN or +inf. `cut` must
/// be monotone and at most its argument, so the result holds every token at or above
/// `cut(max)` of the row's maximum (and the maximum itself), plus perhaps some below.
pub(super) fn scan_window(
    logits: &[f32],
    floor: f32,
    cut: &(impl Fn(f32) -> f32 + Sync),
    out: &mut Vec<Cand>,
    split: bool,
) -> bool {
    if split {
        let size = piece(logits.len());
        let parts: Vec<(Vec<Cand>, bool)> = logits
            .par_chunks(size)
            .enumerate()
            .map(|(c, part)| {
                let mut v = Vec::new();
                let bad = scan_window(part, floor, cut, &mut v, false);
                for cand in &mut v {
                    cand.id += (c * size) as u32;
                }
                (v, bad)
            })
            .collect();
        out.clear();
        let mut bad = false;
        for (v, b) in parts {
            out.extend_from_slice(&v);
            bad |= b;
        }
        return bad;
    }
    let mut max = floor;
    let mut threshold = floor;
    let mut pruned_at = 0usize;
    out.clear();
    let mut visit = |i: usize, l: f32, threshold: &mut f32| {
        if l <= floor {
            return;
        }
        if l > max {
            max = l;
            *threshold = cut(max).max(floor);
            // Drop what fell out of the window once the buffer has doubled.
            if out.len() >= 2 * pruned_at + 64 {
                let t = *threshold;
                out.retain(|c| c.logit >= t);
                pruned_at = out.len();
            }
        }
        out.push(Cand {
            logit: l,
            id: i as u32,
            w: 0.0,
        });
    };
    match kernels::isa() {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `isa()` reports AVX-512F only when the CPU has it.
        kernels::Isa::Avx512 => unsafe { x86::window_avx512(logits, &mut threshold, &mut visit) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `isa()` reports AVX2 only when the CPU has it.
        kernels::Isa::Avx2 => unsafe { x86::window_avx2(logits, &mut threshold, &mut visit) },
        kernels::Isa::Baseline => scan_runs::<SSE2, true>(logits, &mut threshold, visit),
    }
}

/// Appends to `out` every token above `floor` whose value is `>= cut`, in id order, in one
/// vectorised pass of compares.
pub(crate) fn collect(logits: &[f32], floor: f32, cut: f32, out: &mut Vec<Cand>, split: bool) {
    if split {
        let size = piece(logits.len());
        let parts: Vec<Vec<Cand>> = logits
            .par_chunks(size)
            .enumerate()
            .map(|(c, part)| {
                let mut v = Vec::new();
                collect(part, floor, cut, &mut v, false);
                for cand in &mut v {
                    cand.id += (c * size) as u32;
                }
                v
            })
            .collect();
        for v in parts {
            out.extend_from_slice(&v);
        }
        return;
    }
    match kernels::isa() {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `isa()` reports AVX-512F only when the CPU has it.
        kernels::Isa::Avx512 => unsafe { x86::collect_avx512(logits, floor, cut, out) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `isa()` reports AVX2 only when the CPU has it.
        kernels::Isa::Avx2 => unsafe { x86::collect_avx2(logits, floor, cut, out) },
        kernels::Isa::Baseline => collect_body::<SSE2>(logits, floor, cut, out),
    }
}

/// The lowest index whose value is `>= t`, in a vectorised pass that stops there. For rows
/// already checked for NaN (a NaN would count as a hit).
pub(crate) fn first_at_least(values: &[f32], t: f32) -> Option<usize> {
    match kernels::isa() {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `isa()` reports AVX-512F only when the CPU has it.
        kernels::Isa::Avx512 => unsafe { x86::first_at_least_avx512(values, t) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `isa()` reports AVX2 only when the CPU has it.
        kernels::Isa::Avx2 => unsafe { x86::first_at_least_avx2(values, t) },
        kernels::Isa::Baseline => first_at_least_body::<SSE2>(values, t),
    }
}

#[inline(always)]
fn first_at_least_body<const ISA: u8>(values: &[f32], t: f32) -> Option<usize> {
    let whole = values.len() / RUN * RUN;
    for (r, run) in values[..whole].chunks_exact(RUN).enumerate() {
        let mask = run_mask::<ISA, true>(run, t);
        if mask != 0 {
            return Some(r * RUN + mask.trailing_zeros() as usize);
        }
    }
    values[whole..]
        .iter()
        .position(|&x| x >= t || x.is_nan())
        .map(|j| whole + j)
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::Cand;

    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn first_at_least_avx512(values: &[f32], t: f32) -> Option<usize> {
        super::first_at_least_body::<{ super::AVX512 }>(values, t)
    }

    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn first_at_least_avx2(values: &[f32], t: f32) -> Option<usize> {
        super::first_at_least_body::<{ super::AVX2 }>(values, t)
    }

    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn scan_top_avx512(
        logits: &[f32],
        floor: f32,
        keep: usize,
        exclude: &[u64],
        out: &mut Vec<Cand>,
    ) -> bool {
        super::scan_top_body::<{ super::AVX512 }>(logits, floor, keep, exclude, out)
    }

    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn scan_top_avx2(
        logits: &[f32],
        floor: f32,
        keep: usize,
        exclude: &[u64],
        out: &mut Vec<Cand>,
    ) -> bool {
        super::scan_top_body::<{ super::AVX2 }>(logits, floor, keep, exclude, out)
    }

    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn window_avx512(
        logits: &[f32],
        threshold: &mut f32,
        visit: &mut impl FnMut(usize, f32, &mut f32),
    ) -> bool {
        super::scan_runs::<{ super::AVX512 }, true>(logits, threshold, visit)
    }

    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn window_avx2(
        logits: &[f32],
        threshold: &mut f32,
        visit: &mut impl FnMut(usize, f32, &mut f32),
    ) -> bool {
        super::scan_runs::<{ super::AVX2 }, true>(logits, threshold, visit)
    }

    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn collect_avx512(logits: &[f32], floor: f32, cut: f32, out: &mut Vec<Cand>) {
        super::collect_body::<{ super::AVX512 }>(logits, floor, cut, out)
    }

    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn collect_avx2(logits: &[f32], floor: f32, cut: f32, out: &mut Vec<Cand>) {
        super::collect_body::<{ super::AVX2 }>(logits, floor, cut, out)
    }
}

/// Values per run of the vectorised compares: one bit mask per run.
const RUN: usize = 64;

/// Instruction-set levels of [`run_mask`]: SSE2 (part of x86-64), AVX2, AVX-512F.
const SSE2: u8 = 0;
const AVX2: u8 = 1;
const AVX512: u8 = 2;

/// The bit mask of one run: bit `j` is set when `run[j] > t` (`>= t` when `INCLUSIVE`) or
/// `run[j]` is NaN (unordered compares: one instruction per vector). `ISA` picks the
/// instructions; a level above SSE2 is only instantiated inside functions compiled with that
/// level enabled (the target_feature wrappers of [`x86`]).
#[inline(always)]
fn run_mask<const ISA: u8, const INCLUSIVE: bool>(run: &[f32], t: f32) -> u64 {
    debug_assert_eq!(run.len(), RUN);
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::*;
        // SAFETY: `run` holds RUN = 64 values (unaligned loads); levels above SSE2 run only
        // where the caller was compiled with them (see above); SSE2 is part of x86-64.
        unsafe {
            let p = run.as_ptr();
            let mut mask = 0u64;
            if ISA == AVX512 {
                let tv = _mm512_set1_ps(t);
                let cmp = |q: usize| {
                    let x = _mm512_loadu_ps(p.add(16 * q));
                    if INCLUSIVE {
                        _mm512_cmp_ps_mask::<_CMP_NLT_UQ>(x, tv)
                    } else {
                        _mm512_cmp_ps_mask::<_CMP_NLE_UQ>(x, tv)
                    }
                };
                let (m0, m1, m2, m3) = (cmp(0), cmp(1), cmp(2), cmp(3));
                // Most runs pass nothing: one test of the four masks OR-ed, before building
                // the 64-bit mask.
                if (m0 | m1 | m2 | m3) != 0 {
                    mask = u64::from(m0)
                        | (u64::from(m1) << 16)
                        | (u64::from(m2) << 32)
                        | (u64::from(m3) << 48);
                }
            } else if ISA == AVX2 {
                let tv = _mm256_set1_ps(t);
                for q in 0..RUN / 8 {
                    let x = _mm256_loadu_ps(p.add(8 * q));
                    let m = if INCLUSIVE {
                        _mm256_cmp_ps::<_CMP_NLT_UQ>(x, tv)
                    } else {
                        _mm256_cmp_ps::<_CMP_NLE_UQ>(x, tv)
                    };
                    mask |= u64::from(_mm256_movemask_ps(m) as u32) << (8 * q);
                }
            } else {
                let tv = _mm_set1_ps(t);
                for q in 0..RUN / 4 {
                    let x = _mm_loadu_ps(p.add(4 * q));
                    let m = if INCLUSIVE {
                        _mm_cmpnlt_ps(x, tv)
                    } else {
                        _mm_cmpnle_ps(x, tv)
                    };
                    mask |= u64::from(_mm_movemask_ps(m) as u32) << (4 * q);
                }
            }
            mask
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let mut mask = 0u64;
        for (j, &x) in run.iter().enumerate() {
            let p = if INCLUSIVE { !(x < t) } else { !(x <= t) };
            mask |= u64::from(p) << j;
        }
        mask
    }
}

/// Calls `visit(i, values[i], threshold)` for the values above the threshold (at or above
/// when `INCLUSIVE`), in index order, reading the threshold again after each visit; returns
/// whether any value is NaN or +inf (those are never visited). Runs whose mask is empty cost
/// one vector compare each: NaN sets a mask bit, and +inf beats every threshold the callers
/// use (finite or -inf), so both are seen.
#[inline(always)]
fn scan_runs<const ISA: u8, const INCLUSIVE: bool>(
    values: &[f32],
    threshold: &mut f32,
    mut visit: impl FnMut(usize, f32, &mut f32),
) -> bool {
    let pass = |x: f32, t: f32| if INCLUSIVE { x >= t } else { x > t };
    let mut bad = false;
    let whole = values.len() / RUN * RUN;
    for (r, run) in values[..whole].chunks_exact(RUN).enumerate() {
        let mut mask = run_mask::<ISA, INCLUSIVE>(run, *threshold);
        while mask != 0 {
            let j = mask.trailing_zeros() as usize;
            mask &= mask - 1;
            let x = run[j];
            if kernels::is_bad(x) {
                bad = true;
            } else if pass(x, *threshold) {
                visit(r * RUN + j, x, threshold);
            }
        }
    }
    for (j, &x) in values[whole..].iter().enumerate() {
        if kernels::is_bad(x) {
            bad = true;
        } else if pass(x, *threshold) {
            visit(whole + j, x, threshold);
        }
    }
    bad
}

/// [`scan_top`]: a buffer of candidates above a rising threshold. An element enters only if
/// it beats the current `keep`-th best (strictly: an equal element has a higher id, so it ranks
/// lower); the buffer is cut back to `keep` by a linear-time selection whenever it holds
/// `2 keep` elements, raising the threshold. Amortised O(1) per element.
#[inline(always)]
fn scan_top_body<const ISA: u8>(
    logits: &[f32],
    floor: f32,
    keep: usize,
    exclude: &[u64],
    out: &mut Vec<Cand>,
) -> bool {
    out.clear();
    let cap = 2 * keep;
    let mut threshold = floor;
    // The buffer holds rank keys (u64: cheaper to select on than candidates).
    let mut keys = KEYS.with(Cell::take);
    keys.clear();
    let bad = scan_runs::<ISA, false>(logits, &mut threshold, |i, l, threshold| {
        if !exclude.is_empty() && exclude[i / 64] & (1 << (i % 64)) != 0 {
            return;
        }
        keys.push(rank_key_of(l, i as u32));
        if keys.len() >= cap {
            keys.select_nth_unstable(keep - 1);
            keys.truncate(keep);
            *threshold = key_logit(keys[keep - 1]);
        }
    });
    if keys.len() > keep {
        keys.select_nth_unstable(keep - 1);
        keys.truncate(keep);
    }
    out.extend(keys.iter().map(|&k| Cand {
        logit: key_logit(k),
        id: k as u32,
        w: 0.0,
    }));
    KEYS.with(|k| k.set(keys));
    bad
}

thread_local! {
    /// [`scan_top`]'s buffer of rank keys, reused across rows (taken out while in use, so the
    /// hot loop holds no borrow and no closure: closures do not inherit target features).
    static KEYS: Cell<Vec<u64>> = const { Cell::new(Vec::new()) };
}

#[inline(always)]
fn collect_body<const ISA: u8>(logits: &[f32], floor: f32, cut: f32, out: &mut Vec<Cand>) {
    let mut threshold = cut;
    scan_runs::<ISA, true>(logits, &mut threshold, |i, l, _| {
        if l > floor {
            out.push(Cand {
                logit: l,
                id: i as u32,
                w: 0.0,
            });
        }
    });
}

/// Keeps the best `keep` candidates, the worst of them last.
#[inline(never)]
pub(super) fn compact(out: &mut Vec<Cand>, keep: usize) {
    out.select_nth_unstable_by_key(keep - 1, rank_key);
    out.truncate(keep);
}
