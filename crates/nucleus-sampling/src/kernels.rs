//! The vectorised passes over a row that the sampler is built from.
//!
//! Each pass is plain Rust written so that LLVM vectorises it (fixed-width lane arrays with
//! independent accumulators, comparisons as selects), compiled three times on x86-64:
//! baseline (SSE2), AVX2 and AVX-512F, the widest the CPU runs being chosen once at run time.
//! No pass uses fused multiply-adds, and every sum has a fixed lane structure, so each pass
//! gives bitwise the same result on every instruction set, thread count and machine
//! (spec/sampling.md, "Random streams": results never depend on how a row is split).

use std::sync::OnceLock;

use crate::sampler::CHUNK;

/// Independent accumulators of the max pass: enough to hide the latency of the max instruction
/// (4 AVX-512 or 8 AVX2 registers).
const LANES: usize = 64;

/// Lanes of the f64 sums of [`exp_pass`].
const SUM_LANES: usize = 16;

/// Elements per block of [`block_scan`]: a block whose maximum cannot enter the candidate set
/// is skipped after one vectorised max.
pub(crate) const BLOCK: usize = 512;

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
    block_max_bad: fn(&[f32], &mut [f32]) -> bool,
    exp_pass: fn(&[f32], f32, f32, &mut [f32]) -> ExpSums,
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
            if std::arch::is_x86_feature_detected!("avx2") {
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
                    block_max_bad: |row, out| unsafe { x86::block_max_bad_avx512(row, out) },
                    exp_pass: |row, max, t, out| unsafe { x86::exp_pass_avx512(row, max, t, out) },
                };
            }
            if std::arch::is_x86_feature_detected!("avx2") {
                return Kernels {
                    // SAFETY (both): only chosen when the CPU has AVX2 (checked above).
                    max_bad: |row| unsafe { x86::max_bad_avx2(row) },
                    block_max_bad: |row, out| unsafe { x86::block_max_bad_avx2(row, out) },
                    exp_pass: |row, max, t, out| unsafe { x86::exp_pass_avx2(row, max, t, out) },
                };
            }
        }
        Kernels {
            max_bad: max_bad_body,
            block_max_bad: block_max_bad_body,
            exp_pass: exp_pass_body,
        }
    })
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::ExpSums;

    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn max_bad_avx512(row: &[f32]) -> (f32, bool) {
        super::max_bad_body(row)
    }

    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn max_bad_avx2(row: &[f32]) -> (f32, bool) {
        super::max_bad_body(row)
    }

    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn block_max_bad_avx512(row: &[f32], out: &mut [f32]) -> bool {
        super::block_max_bad_body(row, out)
    }

    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn block_max_bad_avx2(row: &[f32], out: &mut [f32]) -> bool {
        super::block_max_bad_body(row, out)
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

    #[target_feature(enable = "avx2")]
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

/// The maximum of each [`BLOCK`]-element block of `values` into `out` (`values.len()` divided
/// by [`BLOCK`], rounded up, entries); whether any value is NaN or `+inf`.
#[inline]
pub(crate) fn block_max_bad(values: &[f32], out: &mut [f32]) -> bool {
    (kernels().block_max_bad)(values, out)
}

#[inline(always)]
fn block_max_bad_body(values: &[f32], out: &mut [f32]) -> bool {
    let mut any_bad = false;
    for (block, o) in values.chunks(BLOCK).zip(out) {
        let (m, bad) = max_bad_body(block);
        *o = m;
        any_bad |= bad;
    }
    any_bad
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

/// The result of [`exp_pass`] over one slice.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct ExpSums {
    /// f64 sum of the weights written, in a fixed lane order.
    pub sum: f64,
    /// Some `l - max` may have overflowed f32 (the row's max is above 1e30): the caller redoes
    /// the slice with the exact scalar formula.
    pub overflow: bool,
}

/// Writes `out[i] = exp_w((row[i] - max) / t)` (0 for `-inf`) and returns their f64 sum.
/// `row` and `out` have the same length; every value `<= max`.
#[inline]
pub(crate) fn exp_pass(row: &[f32], max: f32, t: f32, out: &mut [f32]) -> ExpSums {
    (kernels().exp_pass)(row, max, t, out)
}

#[inline(always)]
fn exp_pass_body(row: &[f32], max: f32, t: f32, out: &mut [f32]) -> ExpSums {
    // Dividing by 1 is the identity: skip the division (the slowest instruction here).
    if t == 1.0 {
        exp_pass_chunks::<false>(row, max, t, out)
    } else {
        exp_pass_chunks::<true>(row, max, t, out)
    }
}

/// Per [`CHUNK`] ids: lane sums, added in lane order to give the chunk's sum; the chunk sums
/// are added in chunk order. So a row split across threads at chunk boundaries gives the
/// same bits.
#[inline(always)]
fn exp_pass_chunks<const DIV: bool>(row: &[f32], max: f32, t: f32, out: &mut [f32]) -> ExpSums {
    const L: usize = SUM_LANES;
    let mut total = 0.0f64;
    // `l - max` leaves f32 (true value below -f32::MAX by more than half an ulp, 2^103) only
    // when `max` is above 2^103 - (the smallest logit's magnitude): not for `max <= 1e30`.
    let overflow = max > 1e30;
    for (part, dst_part) in row.chunks(CHUNK).zip(out.chunks_mut(CHUNK)) {
        let mut sums = [0.0f64; L];
        let n = part.len() / L * L;
        for (chunk, dst) in part[..n]
            .chunks_exact(L)
            .zip(dst_part[..n].chunks_exact_mut(L))
        {
            for i in 0..L {
                let l = chunk[i];
                let w = exp_w(scale::<DIV>(l, l - max, t));
                dst[i] = w;
                sums[i] += f64::from(w);
            }
        }
        let mut part_sum = 0.0f64;
        for x in sums {
            part_sum += x;
        }
        for (&l, o) in part[n..].iter().zip(&mut dst_part[n..]) {
            let w = exp_w(scale::<DIV>(l, l - max, t));
            *o = w;
            part_sum += f64::from(w);
        }
        total += part_sum;
    }
    ExpSums {
        sum: total,
        overflow,
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
            let sums = exp_pass(&row, max, t, &mut out);
            assert!(!sums.overflow);
            let mut want_sum = 0.0f64;
            for (i, &l) in row.iter().enumerate() {
                let w = exp_w((l - max) / t);
                assert_eq!(out[i].to_bits(), w.to_bits(), "id {i}");
                want_sum += f64::from(w);
            }
            assert!((sums.sum - want_sum).abs() <= 1e-12 * want_sum);
        }
        let mut out = vec![0.0; 2];
        assert!(exp_pass(&[f32::MAX, -f32::MAX], f32::MAX, 1.0, &mut out).overflow);
    }
}
