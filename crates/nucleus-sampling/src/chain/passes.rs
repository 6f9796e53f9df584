//! The chain processors' whole-row passes, compiled for the widest instruction set the CPU
//! runs (AVX-512F, AVX2 + FMA, or the build's baseline), chosen at run time as the fixed path's
//! kernels are ([`crate::kernels`]).
//!
//! Each pass is plain Rust over fixed-width runs with one accumulator per lane, written so that
//! LLVM vectorises it (the forms that it does vectorise were measured: see [`D`], [`tree`],
//! [`lane_sum`]); the same body is compiled once per instruction set by [`multiversion!`].
//! Every body gives the same bits on every instruction set: no fused multiply-add is formed
//! implicitly (Rust never contracts `a * b + c`; [`kernels::exp_fma`]'s are explicit
//! `mul_add`s, correctly rounded everywhere), and every f64 sum has a fixed structure: per
//! [`CHUNK`] ids, [`D`] f64 lanes (lane `i` takes values `i, i + D, ...`, the tail padded with a
//! neutral value), the exp passes first summing blocks of 16 terms per f32 lane ([`L`] lanes),
//! the lanes combined in lane order, the chunks in order. That structure depends only on the
//! row (spec/sampling.md, "Random streams": chunking independent of threads), never on the
//! machine.
//!
//! Two exps, as in the fixed path: a sampling weight (the weights a selection draws from,
//! [`exp_weights`], and mirostat's) is [`kernels::exp_w`] of the f32 difference `l - max`; the
//! terms of a statistic (`Z` and the entropy sums of [`sum_exp`] and [`exp_stats`], and the
//! weights those processors compare with a threshold) use [`kernels::exp_fma`], the fixed
//! path's normaliser's exp (fused multiply-adds: the same correctly rounded operation on every
//! instruction set, an instruction where the CPU has FMA). Both are within a few ulps of
//! `exp`; 0 for `-inf` and for a difference that leaves f32.

use crate::kernels::{self, exp_w};
use crate::sampler::CHUNK;

const NEG: f32 = f32::NEG_INFINITY;

/// f32 lanes of the exp passes: 16 (one AVX-512 register, two AVX2 ones).
const L: usize = 16;

/// f64 lanes of the sums: 8 (one AVX-512 register, two AVX2 ones). LLVM vectorises these
/// loops at this width (measured: at 16 f64 lanes it transposes them into strided loads).
const D: usize = 8;

/// Defines a function whose body is compiled three times on x86-64 (AVX-512F, AVX2 + FMA and
/// the baseline), the widest that [`kernels::isa`] reports being called. The body must only
/// call `#[inline(always)]` helpers (or generic code that inlines) to be compiled with the
/// wider instructions.
macro_rules! multiversion {
    ($(#[$attr:meta])* $vis:vis fn $name:ident($($arg:ident: $ty:ty),* $(,)?) $(-> $ret:ty)? $body:block) => {
        $(#[$attr])*
        $vis fn $name($($arg: $ty),*) $(-> $ret)? {
            #[inline(always)]
            fn body($($arg: $ty),*) $(-> $ret)? $body
            #[cfg(test)]
            if tests::BASELINE.with(std::cell::Cell::get) {
                return body($($arg),*);
            }
            #[cfg(target_arch = "x86_64")]
            {
                #[target_feature(enable = "avx512f")]
                unsafe fn avx512($($arg: $ty),*) $(-> $ret)? {
                    body($($arg),*)
                }
                #[target_feature(enable = "avx2,fma")]
                unsafe fn avx2($($arg: $ty),*) $(-> $ret)? {
                    body($($arg),*)
                }
                match kernels::isa() {
                    // SAFETY: `isa()` reports AVX-512F only when the CPU has it.
                    kernels::Isa::Avx512 => return unsafe { avx512($($arg),*) },
                    // SAFETY: `isa()` reports AVX2 (with FMA) only when the CPU has them.
                    kernels::Isa::Avx2 => return unsafe { avx2($($arg),*) },
                    kernels::Isa::Baseline => {}
                }
            }
            body($($arg),*)
        }
    };
}

/// The lanes' f64 partial sums combined in a fixed order (lane 0 first).
#[inline(always)]
fn tree(s: [f64; D]) -> f64 {
    // In lane order. (A pairwise tree here keeps LLVM from holding the lanes in registers:
    // measured 4x slower.)
    s.iter().sum()
}

/// `exp_w(l - max)`, 0 for `-inf`: a sampling weight.
#[inline(always)]
fn weight(l: f32, max: f32) -> f32 {
    exp_w(l - max)
}

/// `exp_fma(l - max)`, 0 for `-inf`: a term of a statistic (the fixed path's normaliser's exp).
#[inline(always)]
fn term(l: f32, max: f32) -> f32 {
    kernels::exp_fma(l - max)
}

/// `sum f(x)` in f64 over `part` (at most [`CHUNK`] long) with [`D`] lanes: lane `i` takes
/// values `i, i + D, ...`, the tail padded with `neutral` (whose `f` must be 0) to a last full
/// run; the lanes combined by [`tree`]. (The padded run keeps the loop one loop: a separate
/// tail loop keeps LLVM from holding the lanes in registers, measured 3x slower.)
#[inline(always)]
fn lane_sum(part: &[f32], neutral: f32, f: impl Fn(f32) -> f64) -> f64 {
    let mut s = [0.0f64; D];
    let runs = part.chunks_exact(D);
    let tail = runs.remainder();
    let mut pad = [neutral; D];
    pad[..tail.len()].copy_from_slice(tail);
    for run in runs.chain(std::iter::once(&pad[..])) {
        for (a, &x) in s.iter_mut().zip(run) {
            *a += f(x);
        }
    }
    tree(s)
}

multiversion! {
    /// The number of finite logits (`l != -inf`; the row holds no NaN or `+inf`).
    pub(crate) fn count_finite(logits: &[f32]) -> usize {
        // An integer count: LLVM vectorises the reduction freely.
        logits.iter().filter(|&&l| l != NEG).count()
    }
}

multiversion! {
    /// `sum exp(l - max)` in f64 ([`kernels::exp_fma`]); no write. Per [`CHUNK`], 16 f32 lanes each sum blocks of
    /// 16 of their terms in f32 (relative error below 1e-6; the exp stays at full vector
    /// width), lane `i`'s block sums going to f64 lane `i mod 8`; the tail's terms go straight
    /// to the f64 lanes (as [`lane_sum`]).
    pub(crate) fn sum_exp(logits: &[f32], max: f32) -> f64 {
        let mut z = 0.0f64;
        for part in logits.chunks(CHUNK) {
            let mut s = [0.0f64; D];
            let blocks = part.chunks_exact(16 * L);
            let rest = blocks.remainder();
            for block in blocks {
                let mut p = [0.0f32; L];
                for run in block.chunks_exact(L) {
                    for (a, &l) in p.iter_mut().zip(run) {
                        *a += term(l, max);
                    }
                }
                for (i, &x) in p.iter().enumerate() {
                    s[i % D] += f64::from(x);
                }
            }
            z += tree(s) + lane_sum(rest, NEG, |l| f64::from(term(l, max)));
        }
        z
    }
}

multiversion! {
    /// `sum w` in f64 over dense f32 weights ([`lane_sum`] per [`CHUNK`], chunks in order).
    pub(crate) fn sum_weights(w: &[f32]) -> f64 {
        let mut z = 0.0f64;
        for part in w.chunks(CHUNK) {
            z += lane_sum(part, 0.0, f64::from);
        }
        z
    }
}

/// The result of [`exp_stats`].
#[derive(Clone, Copy, Debug)]
pub(crate) struct ExpStats {
    /// `z = sum w`.
    pub z: f64,
    /// `sum w (l - max)` over the tokens with `w > 0` (`l - max` in f32).
    pub s: f64,
    /// The number of finite logits.
    pub count: usize,
}

/// Writes `w[i] = exp(l[i] - max)` ([`kernels::exp_fma`]; `w` resized to the row) and returns `z`, `s` and the
/// count of finite logits: one exp pass ([`exp_sums`]) and a count.
pub(crate) fn exp_stats(logits: &[f32], max: f32, w: &mut Vec<f32>) -> ExpStats {
    w.resize(logits.len(), 0.0);
    let (z, s) = exp_sums(logits, max, w, true);
    ExpStats {
        z,
        s,
        count: count_finite(logits),
    }
}

/// Writes `w[i] = exp(l[i] - max)` ([`kernels::exp_fma`]; `w` resized to the row) and returns
/// their f64 sum `z`: one fused pass ([`exp_sums`] without the entropy sum).
pub(crate) fn exp_weights_sum(logits: &[f32], max: f32, w: &mut Vec<f32>) -> f64 {
    w.resize(logits.len(), 0.0);
    exp_sums(logits, max, w, false).0
}

multiversion! {
    /// Writes `w = exp_fma(l - max)` and returns `(sum w, sum w (l - max))` (the second over
    /// `w > 0`, `l - max` in f32; 0 unless `entropy`), both in f64 with [`sum_exp`]'s structure: 16 f32 lanes
    /// summing blocks of 16 terms in f32, each block's sums into f64 lane `i mod 8`; the
    /// chunk's tail padded with `-inf` to whole runs of 16.
    fn exp_sums(logits: &[f32], max: f32, w: &mut [f32], entropy: bool) -> (f64, f64) {
        let (mut z, mut s) = (0.0f64, 0.0f64);
        for (ls, ws) in logits.chunks(CHUNK).zip(w.chunks_mut(CHUNK)) {
            let (mut zl, mut sl) = ([0.0f64; D], [0.0f64; D]);
            let run_terms = |run: &[f32], out: &mut [f32], pz: &mut [f32; L], ps: &mut [f32; L]| {
                for (((a, b), o), &l) in pz.iter_mut().zip(ps.iter_mut()).zip(out.iter_mut()).zip(run) {
                    let d = l - max;
                    let e = kernels::exp_fma(d);
                    *o = e;
                    *a += e;
                    // `d` is -inf where `e` is 0: select, never 0 * -inf. (A loop-invariant
                    // test: LLVM unswitches it.)
                    if entropy {
                        *b += if e > 0.0 { e * d } else { 0.0 };
                    }
                }
            };
            let whole = ls.len() / (16 * L) * (16 * L);
            for (block, wblock) in ls[..whole].chunks_exact(16 * L).zip(ws[..whole].chunks_exact_mut(16 * L)) {
                let (mut pz, mut ps) = ([0.0f32; L], [0.0f32; L]);
                for (run, out) in block.chunks_exact(L).zip(wblock.chunks_exact_mut(L)) {
                    run_terms(run, out, &mut pz, &mut ps);
                }
                for i in 0..L {
                    zl[i % D] += f64::from(pz[i]);
                    sl[i % D] += f64::from(ps[i]);
                }
            }
            // The rest: runs of 16, the last padded with -inf, into one block sum.
            let (mut pz, mut ps) = ([0.0f32; L], [0.0f32; L]);
            let rest = &ls[whole..];
            let wrest = &mut ws[whole..];
            let full = rest.len() / L * L;
            for (run, out) in rest[..full].chunks_exact(L).zip(wrest[..full].chunks_exact_mut(L)) {
                run_terms(run, out, &mut pz, &mut ps);
            }
            let mut pad = [NEG; L];
            let mut wpad = [0.0f32; L];
            let tail = rest.len() - full;
            pad[..tail].copy_from_slice(&rest[full..]);
            run_terms(&pad, &mut wpad, &mut pz, &mut ps);
            wrest[full..].copy_from_slice(&wpad[..tail]);
            for i in 0..L {
                zl[i % D] += f64::from(pz[i]);
                sl[i % D] += f64::from(ps[i]);
            }
            z += tree(zl);
            s += tree(sl);
        }
        (z, s)
    }
}

/// The smallest f32 `c` with `f64::from(c) >= cut` (`+inf` above `f32::MAX`): for every f32
/// `w`, `f64::from(w) < cut` exactly when `w < c`, so the passes compare in f32, 16 lanes wide.
#[inline(always)]
fn f32_cut(cut: f64) -> f32 {
    let c = cut as f32;
    if f64::from(c) < cut {
        c.next_up()
    } else {
        c
    }
}

multiversion! {
    /// Writes `-inf` over every token whose weight `w` is below `cut` (`f64::from(w) < cut`).
    pub(crate) fn mask_weight_below(logits: &mut [f32], w: &[f32], cut: f64) {
        let c = f32_cut(cut);
        for (l, &x) in logits.iter_mut().zip(w) {
            *l = if x < c { NEG } else { *l };
        }
    }
}

multiversion! {
    /// The number of finite logits whose weight `w` is not below `cut`.
    pub(crate) fn count_weight_at_least(logits: &[f32], w: &[f32], cut: f64) -> usize {
        let c = f32_cut(cut);
        logits
            .iter()
            .zip(w)
            .filter(|&(&l, &x)| l != NEG && x >= c)
            .count()
    }
}

multiversion! {
    /// Keeps the tokens ranked at or before `(kl, kid)` in the order (logit descending, id
    /// ascending) and writes `-inf` over the others: `l < kl`, or `l == kl` and `id > kid`.
    pub(crate) fn mask_ranked_after(logits: &mut [f32], kl: f32, kid: u32) {
        let mut base = 0u32;
        let mut runs = logits.chunks_exact_mut(L);
        for run in &mut runs {
            for (k, l) in run.iter_mut().enumerate() {
                let id = base + k as u32;
                *l = if *l < kl || (*l == kl && id > kid) { NEG } else { *l };
            }
            base += L as u32;
        }
        for (k, l) in runs.into_remainder().iter_mut().enumerate() {
            let id = base + k as u32;
            *l = if *l < kl || (*l == kl && id > kid) { NEG } else { *l };
        }
    }
}

multiversion! {
    /// `l /= t` for every finite logit (`-inf` stays `-inf`, also for `t = inf`).
    pub(crate) fn divide_finite(logits: &mut [f32], t: f32) {
        for l in logits.iter_mut() {
            *l = if *l == NEG { NEG } else { *l / t };
        }
    }
}

multiversion! {
    /// Whether some finite logit has `|l| > limit`.
    pub(crate) fn any_abs_above(logits: &[f32], limit: f32) -> bool {
        logits.iter().filter(|&&l| l != NEG && l.abs() > limit).count() > 0
    }
}

multiversion! {
    /// `l = (l - max) / t` for every finite logit, when no difference `l - max` leaves f32
    /// (`false`, row unchanged, otherwise: the caller forms those in f64).
    pub(crate) fn shift_divide(logits: &mut [f32], max: f32, t: f32) -> bool {
        if logits.iter().filter(|&&l| l != NEG && l - max == NEG).count() > 0 {
            return false;
        }
        for l in logits.iter_mut() {
            *l = if *l == NEG { NEG } else { (*l - max) / t };
        }
        true
    }
}

/// The result of [`finite_moments`].
#[derive(Clone, Copy, Debug)]
pub(crate) struct Moments {
    /// The number of finite logits.
    pub count: usize,
    /// Their f64 sum.
    pub sum: f64,
    /// The largest logit (`-inf` for none).
    pub max: f32,
}

/// The count, f64 sum and maximum of the finite logits: three vectorised passes.
pub(crate) fn finite_moments(logits: &[f32]) -> Moments {
    Moments {
        count: count_finite(logits),
        sum: finite_sum(logits),
        max: kernels::max_bad(logits).0,
    }
}

multiversion! {
    /// The f64 sum of the finite logits ([`lane_sum`] per [`CHUNK`], chunks in order).
    fn finite_sum(logits: &[f32]) -> f64 {
        let mut sum = 0.0f64;
        for part in logits.chunks(CHUNK) {
            sum += lane_sum(part, NEG, |l| f64::from(if l != NEG { l } else { 0.0 }));
        }
        sum
    }
}

multiversion! {
    /// `sum (l - mean)^2` in f64 over the finite logits ([`lane_sum`] per [`CHUNK`]).
    pub(crate) fn squared_deviation(logits: &[f32], mean: f64) -> f64 {
        let dev = |l: f32| {
            // Select before the arithmetic: `-inf` contributes `(mean - mean)^2 = 0`.
            let d = if l != NEG { f64::from(l) } else { mean } - mean;
            d * d
        };
        let mut sq = 0.0f64;
        for part in logits.chunks(CHUNK) {
            sq += lane_sum(part, NEG, dev);
        }
        sq
    }
}

multiversion! {
    /// Writes `-inf` over every logit below `threshold` (compared in f64).
    pub(crate) fn mask_below(logits: &mut [f32], threshold: f64) {
        for l in logits.iter_mut() {
            *l = if f64::from(*l) < threshold { NEG } else { *l };
        }
    }
}

multiversion! {
    /// `l = (l - shift) as f32`, the difference in f64, for every finite logit.
    pub(crate) fn subtract_f64(logits: &mut [f32], shift: f64) {
        for l in logits.iter_mut() {
            *l = if *l == NEG { NEG } else { (f64::from(*l) - shift) as f32 };
        }
    }
}

multiversion! {
    /// Sets every weight below `cut` (`f64::from(w) < cut`) to 0; returns whether a non-zero
    /// weight is left.
    pub(crate) fn zero_weights_below(w: &mut [f32], cut: f64) -> bool {
        let c = f32_cut(cut);
        for x in w.iter_mut() {
            *x = if *x < c { 0.0 } else { *x };
        }
        // Stops at the first kept weight (early in a row, where the best tokens often are).
        w.iter().any(|&x| x > 0.0)
    }
}

/// Lanes of the counting and level passes: 64 (four AVX-512 registers), so that the
/// additions of one lane do not wait on each other.
const R: usize = 64;

/// The number of values `>= cut` (NaN counts).
pub(crate) fn count_at_least(values: &[f32], cut: f32) -> usize {
    #[cfg(test)]
    if tests::BASELINE.with(std::cell::Cell::get) {
        return values.iter().filter(|&&x| x >= cut || x.is_nan()).count();
    }
    let whole = values.len() / R * R;
    let head = {
        #[cfg(target_arch = "x86_64")]
        if kernels::isa() == kernels::Isa::Avx512 {
            // SAFETY: `isa()` reports AVX-512F only when the CPU has it.
            unsafe { count_at_least_avx512(&values[..whole], cut) }
        } else if kernels::isa() == kernels::Isa::Avx2 {
            // SAFETY: `isa()` reports AVX2 only when the CPU has it.
            unsafe { count_at_least_avx2(&values[..whole], cut) }
        } else {
            values[..whole]
                .iter()
                .filter(|&&x| x >= cut || x.is_nan())
                .count()
        }
        #[cfg(not(target_arch = "x86_64"))]
        values[..whole]
            .iter()
            .filter(|&&x| x >= cut || x.is_nan())
            .count()
    };
    head + values[whole..]
        .iter()
        .filter(|&&x| x >= cut || x.is_nan())
        .count()
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn count_at_least_avx512(values: &[f32], cut: f32) -> usize {
    use std::arch::x86_64::*;
    let t = _mm512_set1_ps(cut);
    let mut n = [0usize; 4];
    for run in values.chunks_exact(R) {
        for (q, nq) in n.iter_mut().enumerate() {
            // SAFETY: `run` holds R = 64 values, 16 per q.
            let x = unsafe { _mm512_loadu_ps(run.as_ptr().add(16 * q)) };
            // Not below: at least `cut`, or NaN.
            *nq += _mm512_cmp_ps_mask::<_CMP_NLT_UQ>(x, t).count_ones() as usize;
        }
    }
    n.iter().sum()
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn count_at_least_avx2(values: &[f32], cut: f32) -> usize {
    use std::arch::x86_64::*;
    let t = _mm256_set1_ps(cut);
    let mut n = [0usize; 4];
    for run in values.chunks_exact(R) {
        for (q, nq) in n.iter_mut().enumerate() {
            // SAFETY: `run` holds R = 64 values, 16 per q.
            let (a, b) = unsafe {
                (
                    _mm256_loadu_ps(run.as_ptr().add(16 * q)),
                    _mm256_loadu_ps(run.as_ptr().add(16 * q + 8)),
                )
            };
            // Not below: at least `cut`, or NaN.
            let ma = _mm256_movemask_ps(_mm256_cmp_ps::<_CMP_NLT_UQ>(a, t)) as u32;
            let mb = _mm256_movemask_ps(_mm256_cmp_ps::<_CMP_NLT_UQ>(b, t)) as u32;
            *nq += (ma | mb << 8).count_ones() as usize;
        }
    }
    n.iter().sum()
}

/// Thresholds of one [`mass_above_levels`] pass (its AVX-512 code is written for 3).
pub(crate) const MASS_LEVELS: usize = 3;

/// Lanes of [`mass_above_levels`]: 32 (two AVX-512 registers per level).
const MR: usize = 32;

/// Elements per block of [`mass_above_levels`]'s f32 lane sums before they go to f64: each
/// of the [`MR`] lanes adds at most `MASS_BLOCK / MR` = 32 terms in f32, a relative error
/// below 32 f32 units (2e-6) of the block's mass.
const MASS_BLOCK: usize = 1024;

/// A bound on the relative error of [`mass_above_levels`]'s masses (2e-6 per block, the f64
/// sums of blocks far below): 1e-5.
pub(crate) const MASS_LEVEL_ERROR: f64 = 1e-5;

/// For each of the ascending `levels`, the mass (within [`MASS_LEVEL_ERROR`] relative) and
/// the count of the weights strictly above it; every level `>= 0`. Per block of
/// [`MASS_BLOCK`] weights and per level, [`MR`] f32 lanes (lane `i` takes the weights `i, i +
/// MR, ...`, the tail padded with zeros), then the lanes in f64 in lane order: the same bits
/// from the AVX-512 code (explicit intrinsics, each level's sums in registers) and from the
/// portable body.
pub(crate) fn mass_above_levels(
    w: &[f32],
    levels: &[f32; MASS_LEVELS],
) -> ([f64; MASS_LEVELS], [u64; MASS_LEVELS]) {
    #[cfg(test)]
    if tests::BASELINE.with(std::cell::Cell::get) {
        return mass_above_levels_body(w, levels);
    }
    #[cfg(target_arch = "x86_64")]
    if kernels::isa() == kernels::Isa::Avx512 {
        // SAFETY: `isa()` reports AVX-512F only when the CPU has it.
        return unsafe { mass_above_levels_avx512(w, levels) };
    }
    #[cfg(target_arch = "x86_64")]
    if kernels::isa() == kernels::Isa::Avx2 {
        // SAFETY: `isa()` reports AVX2 only when the CPU has it.
        return unsafe { mass_above_levels_avx2(w, levels) };
    }
    mass_above_levels_body(w, levels)
}

/// The portable [`mass_above_levels`].
fn mass_above_levels_body(
    w: &[f32],
    levels: &[f32; MASS_LEVELS],
) -> ([f64; MASS_LEVELS], [u64; MASS_LEVELS]) {
    let mut mass = [0.0f64; MASS_LEVELS];
    let mut count = [0u64; MASS_LEVELS];
    for block in w.chunks(MASS_BLOCK) {
        let runs = block.chunks_exact(MR);
        let tail = runs.remainder();
        let mut pad = [0.0f32; MR];
        pad[..tail.len()].copy_from_slice(tail);
        for j in 0..MASS_LEVELS {
            let t = levels[j];
            let mut s = [0.0f32; MR];
            for run in block.chunks_exact(MR).chain(std::iter::once(&pad[..])) {
                for i in 0..MR {
                    if run[i] > t {
                        s[i] += run[i];
                        count[j] += 1;
                    }
                }
            }
            mass[j] += s.iter().map(|&x| f64::from(x)).sum::<f64>();
        }
    }
    (mass, count)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn mass_above_levels_avx512(
    w: &[f32],
    levels: &[f32; MASS_LEVELS],
) -> ([f64; MASS_LEVELS], [u64; MASS_LEVELS]) {
    use std::arch::x86_64::*;
    let mut mass = [0.0f64; MASS_LEVELS];
    let mut count = [0u64; MASS_LEVELS];
    let (t0, t1, t2) = (
        _mm512_set1_ps(levels[0]),
        _mm512_set1_ps(levels[1]),
        _mm512_set1_ps(levels[2]),
    );
    let one = _mm512_set1_epi32(1);
    let z = _mm512_setzero_ps();
    let zi = _mm512_setzero_si512();
    for block in w.chunks(MASS_BLOCK) {
        let runs = block.chunks_exact(MR);
        let tail = runs.remainder();
        let mut pad = [0.0f32; MR];
        pad[..tail.len()].copy_from_slice(tail);
        // Level j, lanes 0-15 (a) and 16-31 (b): a mass and a count register each, named so
        // that they stay in registers.
        let (mut s0a, mut s0b, mut s1a, mut s1b, mut s2a, mut s2b) = (z, z, z, z, z, z);
        let (mut c0a, mut c0b, mut c1a, mut c1b, mut c2a, mut c2b) = (zi, zi, zi, zi, zi, zi);
        // One step over 32 values at `p`.
        macro_rules! step {
            ($p:expr) => {{
                let p: *const f32 = $p;
                // SAFETY: `p` points at MR = 32 values.
                let (xa, xb) = unsafe { (_mm512_loadu_ps(p), _mm512_loadu_ps(p.add(16))) };
                let m = _mm512_cmp_ps_mask::<_CMP_GT_OQ>(xa, t0);
                s0a = _mm512_mask_add_ps(s0a, m, s0a, xa);
                c0a = _mm512_mask_add_epi32(c0a, m, c0a, one);
                let m = _mm512_cmp_ps_mask::<_CMP_GT_OQ>(xb, t0);
                s0b = _mm512_mask_add_ps(s0b, m, s0b, xb);
                c0b = _mm512_mask_add_epi32(c0b, m, c0b, one);
                let m = _mm512_cmp_ps_mask::<_CMP_GT_OQ>(xa, t1);
                s1a = _mm512_mask_add_ps(s1a, m, s1a, xa);
                c1a = _mm512_mask_add_epi32(c1a, m, c1a, one);
                let m = _mm512_cmp_ps_mask::<_CMP_GT_OQ>(xb, t1);
                s1b = _mm512_mask_add_ps(s1b, m, s1b, xb);
                c1b = _mm512_mask_add_epi32(c1b, m, c1b, one);
                let m = _mm512_cmp_ps_mask::<_CMP_GT_OQ>(xa, t2);
                s2a = _mm512_mask_add_ps(s2a, m, s2a, xa);
                c2a = _mm512_mask_add_epi32(c2a, m, c2a, one);
                let m = _mm512_cmp_ps_mask::<_CMP_GT_OQ>(xb, t2);
                s2b = _mm512_mask_add_ps(s2b, m, s2b, xb);
                c2b = _mm512_mask_add_epi32(c2b, m, c2b, one);
            }};
        }
        for run in runs {
            step!(run.as_ptr());
        }
        step!(pad.as_ptr());
        for (j, (sa, sb, ca, cb)) in [
            (s0a, s0b, c0a, c0b),
            (s1a, s1b, c1a, c1b),
            (s2a, s2b, c2a, c2b),
        ]
        .into_iter()
        .enumerate()
        {
            let mut lanes = [0.0f32; MR];
            let mut n = [0u32; MR];
            // SAFETY: 16 values at 0 and at 16 within the 32.
            unsafe {
                _mm512_storeu_ps(lanes.as_mut_ptr(), sa);
                _mm512_storeu_ps(lanes.as_mut_ptr().add(16), sb);
                _mm512_storeu_si512(n.as_mut_ptr().cast(), ca);
                _mm512_storeu_si512(n.as_mut_ptr().add(16).cast(), cb);
            }
            mass[j] += lanes.iter().map(|&x| f64::from(x)).sum::<f64>();
            count[j] += n.iter().map(|&x| u64::from(x)).sum::<u64>();
        }
    }
    (mass, count)
}

/// [`mass_above_levels`] on AVX2: per block, one read of the block (from L1) per level, the
/// [`MR`] lanes' masses and counts in eight named registers; a weight at or below the level
/// adds `+0.0` (the masked-out value of `and`), which leaves a lane's non-negative sum's bits
/// as they are, so the bits are those of the portable body.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn mass_above_levels_avx2(
    w: &[f32],
    levels: &[f32; MASS_LEVELS],
) -> ([f64; MASS_LEVELS], [u64; MASS_LEVELS]) {
    use std::arch::x86_64::*;
    let mut mass = [0.0f64; MASS_LEVELS];
    let mut count = [0u64; MASS_LEVELS];
    let z = _mm256_setzero_ps();
    let zi = _mm256_setzero_si256();
    for block in w.chunks(MASS_BLOCK) {
        let runs = block.chunks_exact(MR);
        let tail = runs.remainder();
        let mut pad = [0.0f32; MR];
        pad[..tail.len()].copy_from_slice(tail);
        for j in 0..MASS_LEVELS {
            let t = _mm256_set1_ps(levels[j]);
            let (mut s0, mut s1, mut s2, mut s3) = (z, z, z, z);
            let (mut c0, mut c1, mut c2, mut c3) = (zi, zi, zi, zi);
            // One step over 32 values at `p`: a compare mask is -1 per set lane, so the
            // counts go up by subtracting it.
            macro_rules! step {
                ($p:expr) => {{
                    let p: *const f32 = $p;
                    // SAFETY: `p` points at MR = 32 values.
                    let (x0, x1, x2, x3) = unsafe {
                        (
                            _mm256_loadu_ps(p),
                            _mm256_loadu_ps(p.add(8)),
                            _mm256_loadu_ps(p.add(16)),
                            _mm256_loadu_ps(p.add(24)),
                        )
                    };
                    let m = _mm256_cmp_ps::<_CMP_GT_OQ>(x0, t);
                    s0 = _mm256_add_ps(s0, _mm256_and_ps(m, x0));
                    c0 = _mm256_sub_epi32(c0, _mm256_castps_si256(m));
                    let m = _mm256_cmp_ps::<_CMP_GT_OQ>(x1, t);
                    s1 = _mm256_add_ps(s1, _mm256_and_ps(m, x1));
                    c1 = _mm256_sub_epi32(c1, _mm256_castps_si256(m));
                    let m = _mm256_cmp_ps::<_CMP_GT_OQ>(x2, t);
                    s2 = _mm256_add_ps(s2, _mm256_and_ps(m, x2));
                    c2 = _mm256_sub_epi32(c2, _mm256_castps_si256(m));
                    let m = _mm256_cmp_ps::<_CMP_GT_OQ>(x3, t);
                    s3 = _mm256_add_ps(s3, _mm256_and_ps(m, x3));
                    c3 = _mm256_sub_epi32(c3, _mm256_castps_si256(m));
                }};
            }
            for run in block.chunks_exact(MR) {
                step!(run.as_ptr());
            }
            step!(pad.as_ptr());
            let mut lanes = [0.0f32; MR];
            let mut n = [0u32; MR];
            // SAFETY: 8 values at 0, 8, 16 and 24 within the 32.
            unsafe {
                _mm256_storeu_ps(lanes.as_mut_ptr(), s0);
                _mm256_storeu_ps(lanes.as_mut_ptr().add(8), s1);
                _mm256_storeu_ps(lanes.as_mut_ptr().add(16), s2);
                _mm256_storeu_ps(lanes.as_mut_ptr().add(24), s3);
                _mm256_storeu_si256(n.as_mut_ptr().cast(), c0);
                _mm256_storeu_si256(n.as_mut_ptr().add(8).cast(), c1);
                _mm256_storeu_si256(n.as_mut_ptr().add(16).cast(), c2);
                _mm256_storeu_si256(n.as_mut_ptr().add(24).cast(), c3);
            }
            mass[j] += lanes.iter().map(|&x| f64::from(x)).sum::<f64>();
            count[j] += n.iter().map(|&x| u64::from(x)).sum::<u64>();
        }
    }
    (mass, count)
}

multiversion! {
    /// The f64 sum of the weights strictly above `level` (lanes as [`sum_weights`], per
    /// chunk of [`CHUNK`] ids, the chunk sums in order).
    pub(crate) fn mass_above(w: &[f32], level: f32) -> f64 {
        let mut total = 0.0f64;
        for part in w.chunks(CHUNK) {
            total += lane_sum(part, 0.0, |x| if x > level { f64::from(x) } else { 0.0 });
        }
        total
    }
}

/// Appends to `out` every token whose weight lies in `(lo, hi]`, with its logit and weight,
/// in id order (AVX-512: two compares per 16 weights; else portable).
pub(crate) fn collect_weights_between(
    w: &[f32],
    logits: &[f32],
    lo: f32,
    hi: f32,
    out: &mut Vec<crate::sampler::Cand>,
) {
    let mut push = |i: usize| {
        out.push(crate::sampler::Cand {
            logit: logits[i],
            id: i as u32,
            w: w[i],
        })
    };
    let whole = w.len() / L * L;
    #[cfg(test)]
    let baseline = tests::BASELINE.with(std::cell::Cell::get);
    #[cfg(not(test))]
    let baseline = false;
    #[cfg(target_arch = "x86_64")]
    if kernels::isa() == kernels::Isa::Avx512 && !baseline {
        // SAFETY: `isa()` reports AVX-512F only when the CPU has it.
        unsafe { between_masks_avx512(&w[..whole], lo, hi, &mut push) };
    } else if kernels::isa() == kernels::Isa::Avx2 && !baseline {
        // SAFETY: `isa()` reports AVX2 only when the CPU has it.
        unsafe { between_masks_avx2(&w[..whole], lo, hi, &mut push) };
    } else {
        between_masks(&w[..whole], lo, hi, &mut push);
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = baseline;
        between_masks(&w[..whole], lo, hi, &mut push);
    }
    for (i, &x) in w.iter().enumerate().skip(whole) {
        if x > lo && x <= hi {
            push(i);
        }
    }
}

/// The portable inner loop of [`collect_weights_between`] over whole runs of [`L`].
fn between_masks(w: &[f32], lo: f32, hi: f32, push: &mut impl FnMut(usize)) {
    for (i, &x) in w.iter().enumerate() {
        if x > lo && x <= hi {
            push(i);
        }
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn between_masks_avx512(w: &[f32], lo: f32, hi: f32, push: &mut impl FnMut(usize)) {
    use std::arch::x86_64::*;
    let (l, h) = (_mm512_set1_ps(lo), _mm512_set1_ps(hi));
    for (r, run) in w.chunks_exact(L).enumerate() {
        // SAFETY: `run` holds L = 16 values.
        let x = unsafe { _mm512_loadu_ps(run.as_ptr()) };
        let mut m = _mm512_cmp_ps_mask::<_CMP_GT_OQ>(x, l) & _mm512_cmp_ps_mask::<_CMP_LE_OQ>(x, h);
        while m != 0 {
            push(r * L + m.trailing_zeros() as usize);
            m &= m - 1;
        }
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn between_masks_avx2(w: &[f32], lo: f32, hi: f32, push: &mut impl FnMut(usize)) {
    use std::arch::x86_64::*;
    let (l, h) = (_mm256_set1_ps(lo), _mm256_set1_ps(hi));
    for (r, run) in w.chunks_exact(L).enumerate() {
        // SAFETY: `run` holds L = 16 values.
        let (a, b) = unsafe {
            (
                _mm256_loadu_ps(run.as_ptr()),
                _mm256_loadu_ps(run.as_ptr().add(8)),
            )
        };
        let in_a = _mm256_and_ps(
            _mm256_cmp_ps::<_CMP_GT_OQ>(a, l),
            _mm256_cmp_ps::<_CMP_LE_OQ>(a, h),
        );
        let in_b = _mm256_and_ps(
            _mm256_cmp_ps::<_CMP_GT_OQ>(b, l),
            _mm256_cmp_ps::<_CMP_LE_OQ>(b, h),
        );
        let mut m = _mm256_movemask_ps(in_a) as u32 | (_mm256_movemask_ps(in_b) as u32) << 8;
        while m != 0 {
            push(r * L + m.trailing_zeros() as usize);
            m &= m - 1;
        }
    }
}

multiversion! {
    /// `w[i] = exp_w(l[i] - max)` for the tokens ranked at or before `(kl, kid)` (logit
    /// descending, id ascending), 0 for the others.
    pub(crate) fn exp_ranked_at_most(logits: &[f32], max: f32, kl: f32, kid: u32, w: &mut [f32]) {
        let mut base = 0u32;
        let runs = logits.chunks_exact(L);
        let tail = runs.remainder();
        let mut wruns = w.chunks_exact_mut(L);
        for (run, wrun) in runs.zip(&mut wruns) {
            for (k, (&l, wo)) in run.iter().zip(wrun.iter_mut()).enumerate() {
                let id = base + k as u32;
                let kept = l > kl || (l == kl && id <= kid);
                *wo = if kept { weight(l, max) } else { 0.0 };
            }
            base += L as u32;
        }
        for (k, (&l, wo)) in tail.iter().zip(wruns.into_remainder()).enumerate() {
            let id = base + k as u32;
            let kept = l > kl || (l == kl && id <= kid);
            *wo = if kept { weight(l, max) } else { 0.0 };
        }
    }
}

multiversion! {
    /// Adaptive-p's transform ([`super::AdaptiveP::transform`] step 4): every finite logit
    /// becomes `PEAK - SHARPNESS d^2 / (1 + d)` with `d = |w / z - a| / WIDTH`, in f32 as
    /// llama.cpp computes it (the stored type; `/ z` and `/ WIDTH` as products with the f32
    /// reciprocals): 16 lanes wide.
    pub(crate) fn adaptive_p_logits(logits: &mut [f32], w: &[f32], z: f64, a: f64) {
        use super::stochastic::{ADAPTIVE_P_PEAK, ADAPTIVE_P_SHARPNESS, ADAPTIVE_P_WIDTH};
        let (inv_z, a, inv_width) = ((1.0 / z) as f32, a as f32, (1.0 / ADAPTIVE_P_WIDTH) as f32);
        let (peak, sharpness) = (ADAPTIVE_P_PEAK as f32, ADAPTIVE_P_SHARPNESS as f32);
        for (l, &x) in logits.iter_mut().zip(w) {
            let d = (x * inv_z - a).abs() * inv_width;
            let v = peak - sharpness * (d * d / (1.0 + d));
            *l = if *l == NEG { NEG } else { v };
        }
    }
}

/// Writes `w[i] = exp_w(l[i] - max)` for every token (`w` resized to the row): the fixed
/// path's dispatched exp pass at temperature 1, the same bits as `exp_w(l - max)`.
pub(crate) fn exp_weights(logits: &[f32], max: f32, w: &mut Vec<f32>) {
    w.resize(logits.len(), 0.0);
    // The overflow flag (max above 1e30) only matters to callers that want `l - max` exact;
    // the weights here are defined as `exp_w` of the f32 difference, which the pass computes.
    let _ = kernels::exp_pass(logits, max, 1.0, w);
}

#[cfg(test)]
pub(super) mod tests {
    use super::*;

    thread_local! {
        /// Runs every pass on its baseline body (this thread only).
        pub(in crate::chain) static BASELINE: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
    }

    /// A row with every kind of value: a range of logits, `-inf`, ties, and a length that is
    /// not a multiple of the lanes or the chunk.
    fn row() -> Vec<f32> {
        (0..CHUNK + 1_234)
            .map(|i| match i % 97 {
                0 => NEG,
                1 => 3.0,
                _ => ((i * 7919) % 2003) as f32 * 0.01 - 15.0,
            })
            .collect()
    }

    fn max_of(v: &[f32]) -> f32 {
        v.iter().copied().fold(NEG, f32::max)
    }

    #[test]
    fn sums_are_the_f64_sums_within_rounding() {
        let r = row();
        let max = max_of(&r);
        let w: Vec<f32> = r.iter().map(|&l| exp_w(l - max)).collect();
        let want_z: f64 = w.iter().map(|&x| f64::from(x)).sum();
        let want_s: f64 = r
            .iter()
            .zip(&w)
            .filter(|(_, &x)| x > 0.0)
            .map(|(&l, &x)| f64::from(x) * f64::from(l - max))
            .sum();
        let mut out = vec![0.0; r.len()];
        let st = exp_stats(&r, max, &mut out);
        let fma: Vec<f32> = r.iter().map(|&l| kernels::exp_fma(l - max)).collect();
        assert_eq!(out, fma);
        // f32 blocks of 16 terms: within 1e-6 relative.
        assert!((st.z - want_z).abs() <= 1e-6 * want_z);
        assert!((st.s - want_s).abs() <= 1e-6 * want_s.abs());
        assert_eq!(st.count, r.iter().filter(|&&l| l != NEG).count());
        assert_eq!(st.count, count_finite(&r));
        assert!((sum_exp(&r, max) - want_z).abs() <= 1e-6 * want_z);
        assert!((sum_weights(&w) - want_z).abs() <= 1e-12 * want_z);
        let m = finite_moments(&r);
        let want_sum: f64 = r.iter().filter(|&&l| l != NEG).map(|&l| f64::from(l)).sum();
        assert_eq!((m.count, m.max), (st.count, max));
        assert!((m.sum - want_sum).abs() <= 1e-12 * want_sum.abs());
        let mean = m.sum / m.count as f64;
        let want_sq: f64 = r
            .iter()
            .filter(|&&l| l != NEG)
            .map(|&l| (f64::from(l) - mean).powi(2))
            .sum();
        assert!((squared_deviation(&r, mean) - want_sq).abs() <= 1e-12 * want_sq);
    }

    #[test]
    fn every_body_gives_the_same_bits() {
        let r = row();
        let max = max_of(&r);
        let w: Vec<f32> = r.iter().map(|&l| exp_w(l - max)).collect();
        // Every pass that sums, on the dispatched body and on the baseline one.
        let run = || {
            let mut e = Vec::new();
            let st = exp_stats(&r, max, &mut e);
            let m = finite_moments(&r);
            [
                sum_exp(&r, max),
                sum_weights(&w),
                st.z,
                st.s,
                m.sum,
                squared_deviation(&r, m.sum / m.count as f64),
            ]
            .map(f64::to_bits)
        };
        let dispatched = run();
        BASELINE.with(|b| b.set(true));
        let baseline = run();
        BASELINE.with(|b| b.set(false));
        assert_eq!(dispatched, baseline);
    }

    #[test]
    fn top_p_search_passes_are_exact_and_the_same_on_every_body() {
        // Weights with ties, zeros, subnormals and a length that is not a multiple of the
        // lanes or the blocks.
        let r = row();
        let max = max_of(&r);
        let mut w: Vec<f32> = r.iter().map(|&l| exp_w(l - max)).collect();
        w[5] = 1e-45;
        w[6] = 1e-44;
        let levels = [1e-6f32, 0.01, 0.3];
        let run = || {
            let (mass, count) = mass_above_levels(&w, &levels);
            let mut between = Vec::new();
            collect_weights_between(&w, &r, 0.01, 0.3, &mut between);
            let ids: Vec<u32> = between.iter().map(|c| c.id).collect();
            (
                mass.map(f64::to_bits),
                count,
                count_at_least(&r, -5.0),
                count_at_least(&w, f32::from_bits(1)),
                ids,
                mass_above(&w, 0.01).to_bits(),
            )
        };
        let dispatched = run();
        BASELINE.with(|b| b.set(true));
        let baseline = run();
        BASELINE.with(|b| b.set(false));
        assert_eq!(dispatched, baseline);
        // The AVX2 bodies too where the CPU has AVX2 (the dispatch takes AVX-512 when present).
        #[cfg(target_arch = "x86_64")]
        if std::arch::is_x86_feature_detected!("avx2") {
            let body = mass_above_levels_body(&w, &levels);
            // SAFETY: the CPU has AVX2 (checked above).
            let avx2 = unsafe { mass_above_levels_avx2(&w, &levels) };
            assert_eq!(
                (avx2.0.map(f64::to_bits), avx2.1),
                (body.0.map(f64::to_bits), body.1)
            );
            let whole = r.len() / R * R;
            for (values, cut) in [(&r, -5.0f32), (&w, f32::from_bits(1))] {
                // SAFETY: as above.
                let got = unsafe { count_at_least_avx2(&values[..whole], cut) };
                let want = values[..whole]
                    .iter()
                    .filter(|&&x| x >= cut || x.is_nan())
                    .count();
                assert_eq!(got, want);
            }
            let (mut a, mut b) = (Vec::new(), Vec::new());
            let whole = w.len() / L * L;
            // SAFETY: as above.
            unsafe { between_masks_avx2(&w[..whole], 0.01, 0.3, &mut |i| a.push(i)) };
            between_masks(&w[..whole], 0.01, 0.3, &mut |i| b.push(i));
            assert_eq!(a, b);
        }
        // Against plain f64 sums and counts.
        let (mass, count, at_least, positive, ids, above) = dispatched;
        for (j, &t) in levels.iter().enumerate() {
            let want: f64 = w.iter().filter(|&&x| x > t).map(|&x| f64::from(x)).sum();
            let got = f64::from_bits(mass[j]);
            assert!(
                (got - want).abs() <= MASS_LEVEL_ERROR * want,
                "level {t}: {got} vs {want}"
            );
            assert_eq!(count[j], w.iter().filter(|&&x| x > t).count() as u64);
        }
        assert_eq!(at_least, r.iter().filter(|&&l| l >= -5.0).count());
        assert_eq!(positive, w.iter().filter(|&&x| x > 0.0).count());
        let want: Vec<u32> = (0..w.len() as u32)
            .filter(|&i| w[i as usize] > 0.01 && w[i as usize] <= 0.3)
            .collect();
        assert!(!want.is_empty());
        assert_eq!(ids, want);
        let want: f64 = w.iter().filter(|&&x| x > 0.01).map(|&x| f64::from(x)).sum();
        assert!((f64::from_bits(above) - want).abs() <= 1e-12 * want);
    }

    #[test]
    fn f32_cut_is_the_f64_comparison() {
        let cuts = [
            0.0,
            1e-50,
            1.5e-45,
            1e-3,
            0.1,
            1.0 / 3.0,
            0.5,
            1.0,
            f64::from(f32::MAX),
            f64::from(f32::MAX) * 1.000_000_1,
            1e300,
            -1e-3,
            f64::NEG_INFINITY,
        ];
        let ws = [
            0.0f32,
            1e-45,
            2.8e-45,
            1e-3,
            1e-3f32.next_up(),
            1e-3f32.next_down(),
            0.1,
            0.1f32.next_up(),
            (1.0f32 / 3.0).next_down(),
            1.0 / 3.0,
            (1.0f32 / 3.0).next_up(),
            0.5,
            1.0,
            f32::MAX,
            -1.0,
        ];
        for &cut in &cuts {
            let c = f32_cut(cut);
            for &w in &ws {
                assert_eq!(f64::from(w) < cut, w < c, "w {w:e} cut {cut:e}");
            }
        }
    }

    #[test]
    fn masks_and_counts_follow_their_definitions() {
        let r = row();
        let max = max_of(&r);
        let w: Vec<f32> = r.iter().map(|&l| exp_w(l - max)).collect();
        for cut in [0.0, 1e-3, 0.2, 1.0, 2.0] {
            let mut a = r.clone();
            mask_weight_below(&mut a, &w, cut);
            for i in 0..r.len() {
                let want = if f64::from(w[i]) < cut { NEG } else { r[i] };
                assert_eq!(a[i].to_bits(), want.to_bits(), "id {i} cut {cut}");
            }
            let n = (0..r.len())
                .filter(|&i| r[i] != NEG && f64::from(w[i]) >= cut)
                .count();
            assert_eq!(count_weight_at_least(&r, &w, cut), n);
            let mut z = w.clone();
            let kept = zero_weights_below(&mut z, cut);
            assert_eq!(kept, n > 0);
            for i in 0..r.len() {
                assert_eq!(z[i], if f64::from(w[i]) < cut { 0.0 } else { w[i] });
            }
        }
        // The rank cut at a tie of 3.0 (ids 1, 98, 195, ...): ids up to 195 keep it.
        let mut a = r.clone();
        mask_ranked_after(&mut a, 3.0, 195);
        let mut e = vec![0.0; r.len()];
        exp_ranked_at_most(&r, max, 3.0, 195, &mut e);
        for i in 0..r.len() {
            let kept = r[i] > 3.0 || (r[i] == 3.0 && i <= 195);
            assert_eq!(
                a[i].to_bits(),
                if kept { r[i] } else { NEG }.to_bits(),
                "{i}"
            );
            assert_eq!(e[i], if kept { w[i] } else { 0.0 }, "{i}");
        }
        let mut d = r.clone();
        divide_finite(&mut d, f32::INFINITY);
        assert!(d
            .iter()
            .zip(&r)
            .all(|(&x, &l)| if l == NEG { x == NEG } else { x == 0.0 }));
        let mut d = r.clone();
        divide_finite(&mut d, 0.7);
        assert!(d
            .iter()
            .zip(&r)
            .all(|(&x, &l)| x.to_bits() == (l / 0.7).to_bits()));
        assert!(any_abs_above(&r, 14.9));
        assert!(!any_abs_above(&r, 15.0));
        let mut s = r.clone();
        assert!(shift_divide(&mut s, max, 0.5));
        assert!(s
            .iter()
            .zip(&r)
            .all(|(&x, &l)| x.to_bits() == if l == NEG { NEG } else { (l - max) / 0.5 }.to_bits()));
        let mut big = vec![f32::MAX, -f32::MAX, NEG];
        assert!(!shift_divide(&mut big, f32::MAX, 1.0));
        assert_eq!(big, [f32::MAX, -f32::MAX, NEG]);
        let mut m = r.clone();
        mask_below(&mut m, -1.5);
        assert!(m
            .iter()
            .zip(&r)
            .all(|(&x, &l)| x == if l < -1.5 { NEG } else { l }));
        let mut m = r.clone();
        subtract_f64(&mut m, 2.25);
        assert!(m.iter().zip(&r).all(|(&x, &l)| x.to_bits()
            == if l == NEG {
                NEG
            } else {
                (f64::from(l) - 2.25) as f32
            }
            .to_bits()));
    }
}
