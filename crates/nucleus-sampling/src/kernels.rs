//! The vectorised passes over a row that the sampler is built from.
//!
//! Each pass is plain Rust written so that LLVM vectorises it (fixed-width lane arrays with
//! independent accumulators, comparisons as selects), compiled three times on x86-64:
//! baseline (SSE2), AVX2 + FMA and AVX-512F, the widest the CPU runs being chosen once at run
//! time; the top-p normaliser's block also has explicit AVX-512 intrinsics. Every pass gives
//! bitwise the same result on every instruction set, thread count and machine (spec/sampling.md,
//! "Random streams"): the weights' exp ([`exp_w`]) uses no fused multiply-add; the normaliser's
//! ([`exp_fma`]) uses `f32::mul_add`, which is the same correctly rounded operation as the FMA
//! instruction (libm's `fmaf` where the CPU has none); every sum has a fixed lane and chunk
//! structure; unit tests compare the dispatched passes with the portable bodies bit for bit.

use std::sync::OnceLock;

use crate::sampler::CHUNK;

/// Independent accumulators of the max pass: enough to hide the latency of the max instruction
/// (4 AVX-512 or 8 AVX2 registers).
const LANES: usize = 64;

/// `a > b ? a : b` (one max instruction per lane; ignores a NaN `a`).
#[inline(always)]
fn gt_max(a: f32, b: f32) -> f32 {
    if a > b {
        a
    } else {
        b
    }
}

/// `x` is NaN or `+inf` (the values a logits row must not hold).
#[inline(always)]
pub(crate) fn is_bad(x: f32) -> bool {
    // False for every finite value and -inf; true for NaN (unordered) and +inf.
    !matches!(
        x.partial_cmp(&f32::MAX),
        Some(std::cmp::Ordering::Less | std::cmp::Ordering::Equal)
    )
}

/// The kernels compiled for one instruction set.
struct Kernels {
    max_bad: fn(&[f32]) -> (f32, bool),
    exp_pass: fn(&[f32], f32, f32, &mut [f32]) -> ExpSums,
    max_sum_exp: fn(&[f32], f32) -> MaxSumExp,
}

/// The instruction set the kernels run with.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Isa {
    Baseline,
    #[cfg(target_arch = "x86_64")]
    Avx2,
    #[cfg(target_arch = "x86_64")]
    Avx512,
}

/// The widest instruction set this CPU runs (detected once).
pub(crate) fn isa() -> Isa {
    static ISA: OnceLock<Isa> = OnceLock::new();
    *ISA.get_or_init(|| {
        #[cfg(target_arch = "x86_64")]
        {
            if std::arch::is_x86_feature_detected!("avx512f") {
                return Isa::Avx512;
            }
            if std::arch::is_x86_feature_detected!("avx2")
                && std::arch::is_x86_feature_detected!("fma")
            {
                return Isa::Avx2;
            }
        }
        Isa::Baseline
    })
}

fn kernels() -> &'static Kernels {
    static KERNELS: OnceLock<Kernels> = OnceLock::new();
    KERNELS.get_or_init(|| {
        #[cfg(target_arch = "x86_64")]
        {
            if std::arch::is_x86_feature_detected!("avx512f") {
                return Kernels {
                    // SAFETY (both): only chosen when the CPU has AVX-512F (checked above).
                    max_bad: |row| unsafe { x86::max_bad_avx512(row) },
                    exp_pass: |row, max, t, out| unsafe { x86::exp_pass_avx512(row, max, t, out) },
                    max_sum_exp: |row, t| unsafe { x86::max_sum_exp_avx512(row, t) },
                };
            }
            if std::arch::is_x86_feature_detected!("avx2")
                && std::arch::is_x86_feature_detected!("fma")
            {
                return Kernels {
                    // SAFETY (both): only chosen when the CPU has AVX2 (checked above).
                    max_bad: |row| unsafe { x86::max_bad_avx2(row) },
                    exp_pass: |row, max, t, out| unsafe { x86::exp_pass_avx2(row, max, t, out) },
                    max_sum_exp: |row, t| unsafe { x86::max_sum_exp_avx2(row, t) },
                };
            }
        }
        Kernels {
            max_bad: max_bad_body,
            exp_pass: exp_pass_body,
            max_sum_exp: max_sum_exp_body,
        }
    })
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::{ExpSums, MaxSumExp};

    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn max_sum_exp_avx512(row: &[f32], t: f32) -> MaxSumExp {
        if t == 1.0 {
            super::max_sum_exp_chunks_with::<false, _>(row, t, |b, m, s, t| {
                block_avx512::<false>(b, m, s, t)
            })
        } else {
            super::max_sum_exp_chunks_with::<true, _>(row, t, |b, m, s, t| {
                block_avx512::<true>(b, m, s, t)
            })
        }
    }

    use std::arch::x86_64::*;

    /// [`super::exp_fma`] on 16 lanes: the same operations in the same order, so the same bits.
    #[inline]
    #[target_feature(enable = "avx512f")]
    fn exp16(x: __m512) -> __m512 {
        // max(-104, x): NaN passes through (the second operand is returned for NaN).
        let x = _mm512_max_ps(_mm512_set1_ps(-104.0), x);
        let round = _mm512_set1_ps(12_582_912.0);
        let t = _mm512_fmadd_ps(x, _mm512_set1_ps(std::f32::consts::LOG2_E), round);
        let n = _mm512_sub_ps(t, round);
        let r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693_359_4), x);
        let r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.121_944_4e-4), r);
        let mut p = _mm512_set1_ps(1.987_569_2e-4);
        for c in [
            1.398_199_9e-3,
            8.333_452e-3,
            4.166_579_6e-2,
            1.666_666_5e-1,
            0.5,
        ] {
            p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(c));
        }
        let y = _mm512_add_ps(
            _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), r),
            _mm512_set1_ps(1.0),
        );
        // y * 2^n in one instruction, rounded once (subnormal results included): the same
        // bits as the portable body's (y * 2^n1) * 2^n2.
        _mm512_scalef_ps(y, n)
    }

    /// `scale::<DIV>(l, d, t)` on 16 lanes.
    #[inline]
    #[target_feature(enable = "avx512f")]
    fn scale16<const DIV: bool>(l: __m512, d: __m512, t: __m512) -> __m512 {
        if DIV {
            let masked = _mm512_cmp_ps_mask::<_CMP_EQ_OQ>(l, _mm512_set1_ps(f32::NEG_INFINITY));
            _mm512_mask_blend_ps(masked, _mm512_div_ps(d, t), l)
        } else {
            d
        }
    }

    /// Adds the 16 f32 lanes of `w` to the f64 lane sums `lo` (lanes 0-7) and `hi` (8-15).
    #[inline]
    #[target_feature(enable = "avx512f")]
    fn widen16(w: __m512) -> (__m512d, __m512d) {
        let lo = _mm512_cvtps_pd(_mm512_castps512_ps256(w));
        let hi = _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(
            _mm512_castps_pd(w),
        )));
        (lo, hi)
    }

    /// One block of [`super::max_sum_exp_chunks_with`] on AVX-512: the same arithmetic as
    /// [`super::block_generic`], lane for lane.
    #[target_feature(enable = "avx512f")]
    fn block_avx512<const DIV: bool>(block: &[f32], m: &mut [f32; 16], s: &mut [f64; 16], t: f32) {
        let tv = _mm512_set1_ps(t);
        // SAFETY: m and s are 16 lanes; block is MSE_BLOCK values (a multiple of 16).
        unsafe {
            let mv = _mm512_loadu_ps(m.as_ptr());
            let mut bm = mv;
            for q in 0..block.len() / 16 {
                let x = _mm512_loadu_ps(block.as_ptr().add(16 * q));
                bm = _mm512_max_ps(x, bm);
            }
            let mut slo = _mm512_loadu_pd(s.as_ptr());
            let mut shi = _mm512_loadu_pd(s.as_ptr().add(8));
            // Rescale only when a lane's maximum rose: otherwise the factor is exp(0) = 1
            // exactly, so skipping it keeps the portable body's bits.
            if _mm512_cmp_ps_mask::<_CMP_NEQ_UQ>(mv, bm) != 0 {
                let (rlo, rhi) = widen16(exp16(scale16::<DIV>(mv, _mm512_sub_ps(mv, bm), tv)));
                slo = _mm512_mul_pd(slo, rlo);
                shi = _mm512_mul_pd(shi, rhi);
            }
            let mut part = _mm512_setzero_ps();
            for q in 0..block.len() / 16 {
                let x = _mm512_loadu_ps(block.as_ptr().add(16 * q));
                part = _mm512_add_ps(part, exp16(scale16::<DIV>(x, _mm512_sub_ps(x, bm), tv)));
            }
            let (lo, hi) = widen16(part);
            slo = _mm512_add_pd(slo, lo);
            shi = _mm512_add_pd(shi, hi);
            _mm512_storeu_ps(m.as_mut_ptr(), bm);
            _mm512_storeu_pd(s.as_mut_ptr(), slo);
            _mm512_storeu_pd(s.as_mut_ptr().add(8), shi);
        }
    }

    /// The portable blocks compiled with AVX2 and FMA. The block function is a closure
    /// defined here (closures inherit the enclosing target features): a plain `fn` item passed
    /// to the generic driver would be compiled without FMA, every `mul_add` a libm call.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn max_sum_exp_avx2(row: &[f32], t: f32) -> MaxSumExp {
        if t == 1.0 {
            super::max_sum_exp_chunks_with::<false, _>(row, t, |b, m, s, t| {
                super::block_generic::<false>(b, m, s, t)
            })
        } else {
            super::max_sum_exp_chunks_with::<true, _>(row, t, |b, m, s, t| {
                super::block_generic::<true>(b, m, s, t)
            })
        }
    }

    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn max_bad_avx512(row: &[f32]) -> (f32, bool) {
        super::max_bad_body(row)
    }

    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn max_bad_avx2(row: &[f32]) -> (f32, bool) {
        super::max_bad_body(row)
    }

    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn exp_pass_avx512(
        row: &[f32],
        max: f32,
        t: f32,
        out: &mut [f32],
    ) -> ExpSums {
        super::exp_pass_body(row, max, t, out)
    }

    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn exp_pass_avx2(row: &[f32], max: f32, t: f32, out: &mut [f32]) -> ExpSums {
        super::exp_pass_body(row, max, t, out)
    }
}

/// The maximum of `values` (ignoring NaN; `-inf` for an empty slice) and whether any value is
/// NaN or `+inf`.
#[inline]
pub(crate) fn max_bad(values: &[f32]) -> (f32, bool) {
    (kernels().max_bad)(values)
}

#[inline(always)]
fn max_bad_body(values: &[f32]) -> (f32, bool) {
    let mut acc = [f32::NEG_INFINITY; LANES];
    // u32 lanes (not bool): they stay in vector registers as compare masks.
    let mut bad = [0u32; LANES];
    let chunks = values.chunks_exact(LANES);
    let rest = chunks.remainder();
    for chunk in chunks {
        for ((a, b), &x) in acc.iter_mut().zip(bad.iter_mut()).zip(chunk) {
            *a = gt_max(x, *a);
            *b |= u32::from(is_bad(x));
        }
    }
    // Tree reduction: lane-parallel halvings, which vectorise.
    for half in [32, 16, 8, 4, 2, 1] {
        for i in 0..half {
            acc[i] = gt_max(acc[i + half], acc[i]);
            bad[i] |= bad[i + half];
        }
    }
    let mut m = acc[0];
    let mut any_bad = bad[0] != 0;
    for &x in rest {
        m = gt_max(x, m);
        any_bad |= is_bad(x);
    }
    (m, any_bad)
}

/// The result of [`max_sum_exp`].
#[derive(Clone, Copy, Debug)]
pub(crate) struct MaxSumExp {
    /// The maximum (ignoring NaN; `-inf` for an empty or all `-inf` row).
    pub max: f32,
    /// `sum exp((l - max) / t)` in f64 (within a few 1e-7 relative of the exact sum).
    pub sum: f64,
    /// Some value is NaN or +inf.
    pub bad: bool,
}

/// Lanes of [`max_sum_exp`].
const MSE_LANES: usize = 16;
/// Values per block of [`max_sum_exp`]: the lanes' maxima are raised (and their sums rescaled)
/// once per block.
const MSE_BLOCK: usize = 16 * MSE_LANES;

/// The maximum of `row` and `sum exp((l - max) / t)` in one pass (online softmax: per lane a
/// running maximum and an f64 sum rescaled when the maximum rises, once per block), with the
/// NaN / +inf check. Per [`CHUNK`] ids the lanes are combined in lane order, and the chunks
/// in chunk order, so the result does not depend on how a row is split at chunk boundaries.
/// Uses [`exp_fma`]. Rows whose maximum is above 1e30 need the exact scalar formula instead
/// (`l - max` may overflow).
#[inline]
pub(crate) fn max_sum_exp(row: &[f32], t: f32) -> MaxSumExp {
    (kernels().max_sum_exp)(row, t)
}

#[inline(always)]
fn max_sum_exp_body(row: &[f32], t: f32) -> MaxSumExp {
    if t == 1.0 {
        max_sum_exp_chunks::<false>(row, t)
    } else {
        max_sum_exp_chunks::<true>(row, t)
    }
}

#[inline(always)]
fn max_sum_exp_chunks<const DIV: bool>(row: &[f32], t: f32) -> MaxSumExp {
    max_sum_exp_chunks_with::<DIV, _>(row, t, block_generic::<DIV>)
}

/// One block of [`max_sum_exp`]: raises each lane's maximum `m` to the block's, rescales its
/// sum `s`, then adds the block's `exp((l - m) / t)`; returns non-zero if a value is NaN or +inf.
#[inline(always)]
fn block_generic<const DIV: bool>(
    block: &[f32],
    m: &mut [f32; MSE_LANES],
    s: &mut [f64; MSE_LANES],
    t: f32,
) {
    const L: usize = MSE_LANES;
    let mut bm = *m;
    for run in block.chunks_exact(L) {
        for i in 0..L {
            bm[i] = gt_max(run[i], bm[i]);
        }
    }
    for i in 0..L {
        s[i] *= f64::from(exp_fma(scale::<DIV>(m[i], m[i] - bm[i], t)));
    }
    *m = bm;
    // The block's terms in f32 per lane (16 terms: relative error below 1e-6), then into f64.
    let mut part = [0.0f32; L];
    for run in block.chunks_exact(L) {
        for i in 0..L {
            part[i] += exp_fma(scale::<DIV>(run[i], run[i] - m[i], t));
        }
    }
    for i in 0..L {
        s[i] += f64::from(part[i]);
    }
}

#[inline(always)]
fn max_sum_exp_chunks_with<const DIV: bool, B>(row: &[f32], t: f32, mut block_fn: B) -> MaxSumExp
where
    B: FnMut(&[f32], &mut [f32; MSE_LANES], &mut [f64; MSE_LANES], f32),
{
    const L: usize = MSE_LANES;
    let mut max = f32::NEG_INFINITY;
    let mut sum = 0.0f64;
    let mut bad = 0u32;
    for part in row.chunks(CHUNK) {
        // f32::MIN, not -inf: the first rescale is exp(MIN - m) = 0, never exp(-inf + inf).
        let mut m = [f32::MIN; L];
        let mut s = [0.0f64; L];
        let whole = part.len() / MSE_BLOCK * MSE_BLOCK;
        for block in part[..whole].chunks_exact(MSE_BLOCK) {
            block_fn(block, &mut m, &mut s, t);
        }
        // NaN or +inf in a block: a NaN term (NaN, or inf - inf) stays in its lane's sum, and
        // no finite row makes one; the maximum shows +inf too.
        if s.iter().any(|x| x.is_nan()) || m.contains(&f32::INFINITY) {
            bad = 1;
        }
        let mut pm = f32::NEG_INFINITY;
        for &x in m.iter().chain(&part[whole..]) {
            pm = gt_max(x, pm);
        }
        for &x in &part[whole..] {
            bad |= u32::from(is_bad(x));
        }
        // The lanes start at f32::MIN: it stands for -inf unless a value is f32::MIN.
        if pm == f32::MIN && !part.contains(&f32::MIN) {
            pm = f32::NEG_INFINITY;
        }
        let mut ps = 0.0f64;
        if pm > f32::NEG_INFINITY {
            for i in 0..L {
                ps += s[i] * f64::from(exp_fma(scale::<DIV>(m[i], m[i] - pm, t)));
            }
            for &x in &part[whole..] {
                ps += f64::from(exp_fma(scale::<DIV>(x, x - pm, t)));
            }
        }
        let next = MaxSumExp {
            max: pm,
            sum: ps,
            bad: false,
        };
        (max, sum) = combine(max, sum, next, t);
    }
    MaxSumExp {
        max,
        sum,
        bad: bad != 0,
    }
}

/// Chunk order: adds a chunk's (maximum, sum relative to it) to the running pair, rescaling
/// the running sum when the chunk raises the maximum.
#[inline(always)]
fn combine(max: f32, sum: f64, next: MaxSumExp, t: f32) -> (f32, f64) {
    let (pm, ps) = (next.max, next.sum);
    if pm > max {
        let mut sum = sum;
        if max > f32::NEG_INFINITY {
            sum *= f64::from(exp_fma(scale::<true>(max, max - pm, t)));
        }
        (pm, sum + ps)
    } else if pm > f32::NEG_INFINITY {
        (
            max,
            sum + ps * f64::from(exp_fma(scale::<true>(pm, pm - max, t))),
        )
    } else {
        (max, sum)
    }
}

/// Folds per-chunk results of [`max_sum_exp`] (each over exactly one [`CHUNK`]-aligned chunk),
/// in chunk order: the same bits as [`max_sum_exp`] over the whole row.
pub(crate) fn max_sum_exp_fold(parts: impl Iterator<Item = MaxSumExp>, t: f32) -> MaxSumExp {
    let (mut max, mut sum, mut bad) = (f32::NEG_INFINITY, 0.0f64, false);
    for part in parts {
        bad |= part.bad;
        (max, sum) = combine(max, sum, part, t);
    }
    MaxSumExp { max, sum, bad }
}

/// The result of [`exp_pass`] over one slice.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct ExpSums {
    /// Some `l - max` may have overflowed f32 (the row's max is above 1e30): the caller redoes
    /// the slice with the exact scalar formula.
    pub overflow: bool,
}

/// Writes `out[i] = exp_w((row[i] - max) / t)` (0 for `-inf`). `row` and `out` have the same
/// length; every value `<= max`.
#[inline]
pub(crate) fn exp_pass(row: &[f32], max: f32, t: f32, out: &mut [f32]) -> ExpSums {
    (kernels().exp_pass)(row, max, t, out)
}

#[inline(always)]
fn exp_pass_body(row: &[f32], max: f32, t: f32, out: &mut [f32]) -> ExpSums {
    // Dividing by 1 is the identity: skip the division (the slowest instruction here).
    if t == 1.0 {
        exp_pass_all::<false>(row, max, t, out);
    } else {
        exp_pass_all::<true>(row, max, t, out);
    }
    // `l - max` leaves f32 (true value below -f32::MAX by more than half an ulp, 2^103) only
    // when `max` is above 2^103 - (the smallest logit's magnitude): not for `max <= 1e30`.
    ExpSums {
        overflow: max > 1e30,
    }
}

#[inline(always)]
fn exp_pass_all<const DIV: bool>(row: &[f32], max: f32, t: f32, out: &mut [f32]) {
    for (&l, o) in row.iter().zip(out.iter_mut()) {
        *o = exp_w(scale::<DIV>(l, l - max, t));
    }
}

/// `d / t` (`d = l - max`), keeping `-inf` when `l` is `-inf` (a temperature beyond f32 is inf,
/// and `-inf / inf` would be NaN); `d` itself when not `DIV` (`t == 1`).
#[inline(always)]
fn scale<const DIV: bool>(l: f32, d: f32, t: f32) -> f32 {
    if !DIV {
        d
    } else if l == f32::NEG_INFINITY {
        l
    } else {
        d / t
    }
}

/// `e^x` in f32 for `x <= 0` (the weights `exp((l - max) / T)`), written without a libm call so
/// that it vectorises, and without fused multiply-adds so that every instruction set gives the
/// same bits: Cody–Waite range reduction `x = n ln 2 + r`, Cephes' degree-6 polynomial for
/// `e^r` on `|r| <= ln 2 / 2`, and `2^n` as two factors so that results in the subnormal range
/// are right too. Relative error about 2e-7 (a couple of ulps) for normal results; 0 below
/// -104 (where `e^x` is below half the smallest subnormal) and for `-inf`.
#[inline(always)]
pub(crate) fn exp_w(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    const ROUND: f32 = 12_582_912.0; // 1.5 * 2^23
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    let tiny = x < -104.0;
    let x = if tiny { -104.0 } else { x };
    let x = if x > 0.0 { 0.0 } else { x };
    let t = x * LOG2E + ROUND;
    let n = t - ROUND;
    let r = (x - n * LN2_HI) - n * LN2_LO;
    let mut p = 1.987_569_2e-4f32;
    p = p * r + 1.398_199_9e-3;
    p = p * r + 8.333_452e-3;
    p = p * r + 4.166_579_6e-2;
    p = p * r + 1.666_666_5e-1;
    p = p * r + 0.5;
    let y = (p * (r * r) + r) + 1.0;
    // t's low mantissa bits hold n + 2^22; split 2^n into two normal factors (n >= -151).
    let ni = t.to_bits() as i32 - 0x4B40_0000;
    let n1 = ni >> 1;
    let n2 = ni - n1;
    let f1 = f32::from_bits(((n1 + 127) << 23) as u32);
    let f2 = f32::from_bits(((n2 + 127) << 23) as u32);
    let v = (y * f1) * f2;
    if tiny {
        0.0
    } else {
        v
    }
}

/// `e^x` for `x <= 0` with fused multiply-adds (`f32::mul_add`: one instruction where the CPU
/// has FMA, the correctly rounded libm `fmaf` elsewhere, so the bits are the same everywhere):
/// [`exp_w`]'s polynomial and its two-factor `2^n` (subnormal results below -87.3, 0 below
/// about -104; `-inf` gives 0, NaN stays NaN). For the top-p normaliser only; weights use
/// [`exp_w`].
#[inline(always)]
pub(crate) fn exp_fma(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    const ROUND: f32 = 12_582_912.0; // 1.5 * 2^23
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    // max(-104, x) with NaN passing through (the AVX-512 form is `max_ps(-104, x)`).
    let x = if -104.0 > x { -104.0 } else { x };
    let t = x.mul_add(LOG2E, ROUND);
    let n = t - ROUND;
    let r = (-n).mul_add(LN2_LO, (-n).mul_add(LN2_HI, x));
    let mut p = 1.987_569_2e-4f32;
    p = p.mul_add(r, 1.398_199_9e-3);
    p = p.mul_add(r, 8.333_452e-3);
    p = p.mul_add(r, 4.166_579_6e-2);
    p = p.mul_add(r, 1.666_666_5e-1);
    p = p.mul_add(r, 0.5);
    let y = p.mul_add(r * r, r) + 1.0;
    // t's low mantissa bits hold n + 2^22. y * 2^n as (y * 2^n1) * 2^n2 with both factors
    // normal (n >= -151): one rounding, the same as one exact scaling (AVX-512's scalef).
    let ni = t.to_bits() as i32 - 0x4B40_0000;
    let n1 = ni >> 1;
    let n2 = ni - n1;
    let f1 = f32::from_bits(((n1 + 127) << 23) as u32);
    let f2 = f32::from_bits(((n2 + 127) << 23) as u32);
    (y * f1) * f2
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exp_w_is_within_a_few_ulps_of_exp_down_to_subnormals() {
        let mut worst = 0.0f64;
        let mut x = -87.0f32;
        while x <= 0.0 {
            let want = f64::from(x).exp();
            let got = f64::from(exp_w(x));
            worst = worst.max(((got - want) / want).abs());
            x += 0.000_37;
        }
        assert!(worst < 4e-7, "worst relative error {worst}");
        assert_eq!(exp_w(0.0), 1.0);
        assert_eq!(exp_w(f32::NEG_INFINITY), 0.0);
        assert_eq!(exp_w(-200.0), 0.0);
        // Subnormal results: within one subnormal step (1.4e-45) of the true value.
        let mut x = -103.9f32;
        while x < -87.0 {
            let want = f64::from(x).exp();
            let got = f64::from(exp_w(x));
            assert!((got - want).abs() <= 1.5e-45_f64.max(want * 4e-7), "{x}");
            x += 0.01;
        }
        // Monotone on a fine grid.
        let mut prev = 0.0f32;
        let mut x = -110.0f32;
        while x <= 0.0 {
            let w = exp_w(x);
            assert!(w >= prev, "not monotone at {x}");
            prev = w;
            x += 0.000_61;
        }
    }

    #[test]
    fn max_sum_exp_equals_the_f64_sum() {
        let row: Vec<f32> = (0..20_011)
            .map(|i| {
                ((i * 7919) % 2003) as f32 * 0.01 - 20.0 + if i == 15_000 { 40.0 } else { 0.0 }
            })
            .chain([f32::NEG_INFINITY])
            .collect();
        let max = max_of(&row);
        for t in [1.0f32, 0.7, 3.0] {
            let got = max_sum_exp(&row, t);
            assert_eq!(got.max, max);
            assert!(!got.bad);
            let want: f64 = row
                .iter()
                .map(|&l| ((f64::from(l) - f64::from(max)) / f64::from(t)).exp())
                .sum();
            assert!(
                (got.sum - want).abs() <= 1e-6 * want,
                "{} vs {want}",
                got.sum
            );
            // The baseline body gives the same bits as the dispatched one.
            let base = max_sum_exp_body(&row, t);
            assert_eq!(base.sum.to_bits(), got.sum.to_bits());
        }
        // NaN or +inf anywhere: in a block, in a chunk's tail, in a chunk of only NaN and
        // -inf, on every instruction set's path (dispatched and portable bodies).
        for (at, v) in [
            (20_005, f32::NAN),
            (100, f32::NAN),
            (9_000, f32::INFINITY),
            (8_191, f32::NAN),
        ] {
            let mut bad_row = row.clone();
            bad_row[at] = v;
            for t in [1.0, 0.5] {
                assert!(max_sum_exp(&bad_row, t).bad, "{v} at {at}, t {t}");
                assert!(max_sum_exp_body(&bad_row, t).bad, "{v} at {at}, t {t}");
            }
        }
        let mut masked = vec![f32::NEG_INFINITY; 8192 * 2];
        masked[8192 + 300] = f32::NAN;
        masked[5] = 1.0;
        assert!(max_sum_exp(&masked, 1.0).bad);
        assert!(max_sum_exp_body(&masked, 1.0).bad);
        let mut nan = row.clone();
        nan[20_005] = f32::NAN;
        assert!(max_sum_exp(&nan, 1.0).bad);
        assert!(max_sum_exp(&nan[..100], 1.0).max < 21.0);
        let all_masked = [f32::NEG_INFINITY; 300];
        let r = max_sum_exp(&all_masked, 1.0);
        assert_eq!((r.max, r.sum, r.bad), (f32::NEG_INFINITY, 0.0, false));
    }

    #[test]
    fn exp_fma_is_within_a_few_ulps_of_exp() {
        let mut x = -87.0f32;
        while x <= 0.0 {
            let want = f64::from(x).exp();
            let got = f64::from(exp_fma(x));
            assert!(((got - want) / want).abs() < 4e-7, "{x}");
            x += 0.000_37;
        }
        // Subnormal results: within one subnormal step of the true value.
        let mut x = -103.9f32;
        while x < -87.0 {
            let want = f64::from(x).exp();
            let got = f64::from(exp_fma(x));
            assert!((got - want).abs() <= 1.5e-45_f64.max(want * 4e-7), "{x}");
            x += 0.01;
        }
        assert_eq!(exp_fma(f32::NEG_INFINITY), 0.0);
        assert_eq!(exp_fma(-200.0), 0.0);
        assert!(exp_fma(f32::NAN).is_nan());
    }

    #[test]
    fn max_sum_exp_is_the_same_bits_on_every_body_down_to_subnormal_terms() {
        // Terms from e^0 down to below the smallest subnormal, at two temperatures.
        let row: Vec<f32> = (0..9_000).map(|i| -(i as f32) * 0.0131).collect();
        for t in [1.0f32, 0.9] {
            let mut a = max_sum_exp(&row, t);
            let b = max_sum_exp_body(&row, t);
            assert_eq!(a.sum.to_bits(), b.sum.to_bits(), "t {t}");
            a.bad |= b.bad;
            assert!(!a.bad);
        }
    }

    #[test]
    fn max_bad_finds_the_max_and_any_nan_or_inf() {
        let mut v: Vec<f32> = (0..1000).map(|i| ((i * 37) % 101) as f32 - 50.0).collect();
        assert_eq!(max_bad(&v), (50.0, false));
        assert_eq!(max_bad(&v[..3]), (max_of(&v[..3]), false));
        v[999] = f32::NAN;
        assert!(max_bad(&v).1);
        v[999] = f32::INFINITY;
        assert!(max_bad(&v).1);
        v[999] = f32::NEG_INFINITY;
        assert_eq!(max_bad(&v), (50.0, false));
        assert_eq!(max_bad(&[]), (f32::NEG_INFINITY, false));
    }

    fn max_of(v: &[f32]) -> f32 {
        v.iter().copied().fold(f32::NEG_INFINITY, f32::max)
    }

    #[test]
    fn exp_pass_equals_its_scalar_definition() {
        let row: Vec<f32> = (0..20_003)
            .map(|i| ((i * 7919) % 2003) as f32 * 0.01 - 20.0)
            .chain([f32::NEG_INFINITY])
            .collect();
        let max = max_of(&row);
        for t in [1.0f32, 0.7] {
            let mut out = vec![0.0; row.len()];
            assert!(!exp_pass(&row, max, t, &mut out).overflow);
            for (i, &l) in row.iter().enumerate() {
                let w = exp_w((l - max) / t);
                assert_eq!(out[i].to_bits(), w.to_bits(), "id {i}");
            }
        }
        let mut out = vec![0.0; 2];
        assert!(exp_pass(&[f32::MAX, -f32::MAX], f32::MAX, 1.0, &mut out).overflow);
    }
}
