//! The two floors every sampler is measured against (spec: "speed is a ratio against the
//! memory-bandwidth floor"): one vectorised max pass over the row, and one pass computing the
//! max and the sum of `exp(x - max)` (online softmax with a polynomial exp that vectorises).
//!
//! Both are plain Rust written so LLVM vectorises them: fixed-width lane arrays with independent
//! accumulators, no early exits, comparisons as selects. The workspace compiles for baseline
//! x86-64 (SSE2); a floor is the machine's, so on x86-64 each pass is also compiled with
//! AVX2 + FMA and AVX-512F (`#[target_feature]`; the polynomial then uses fused multiply-adds)
//! and [`Isa::best`] picks the widest the CPU has. Input rows must be finite.

/// Lanes of the max pass: 64 independent accumulators (4 AVX-512 or 8 AVX2 registers), enough
/// to hide the latency of the max instruction.
const MAX_LANES: usize = 64;

/// Lanes of the sum-of-exp pass.
const EXP_LANES: usize = 32;

/// Elements per block of the online softmax: the block max is found first (data in L1), then
/// the running sums are rescaled once per block, so the pass costs one exp per element.
const EXP_BLOCK: usize = 16 * EXP_LANES;

/// An instruction set a floor pass is compiled for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Isa {
    /// Whatever the crate is compiled for (baseline x86-64: SSE2), as nucleus-sampling is.
    Baseline,
    /// x86-64 AVX2 and FMA (256-bit vectors).
    Avx2,
    /// x86-64 AVX-512F (512-bit vectors).
    Avx512,
}

impl Isa {
    /// The widest instruction set this CPU runs.
    pub fn best() -> Self {
        [Isa::Avx512, Isa::Avx2]
            .into_iter()
            .find(|isa| isa.available())
            .unwrap_or(Isa::Baseline)
    }

    /// Whether this CPU runs it.
    pub fn available(self) -> bool {
        match self {
            Isa::Baseline => true,
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 => {
                std::arch::is_x86_feature_detected!("avx2")
                    && std::arch::is_x86_feature_detected!("fma")
            }
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512 => std::arch::is_x86_feature_detected!("avx512f"),
            #[cfg(not(target_arch = "x86_64"))]
            _ => false,
        }
    }

    /// `"baseline"`, `"avx2"`, `"avx512"`.
    pub fn name(self) -> &'static str {
        match self {
            Isa::Baseline => "baseline",
            Isa::Avx2 => "avx2",
            Isa::Avx512 => "avx512",
        }
    }
}

/// The maximum of a finite, non-empty `row`, compiled for `isa` (baseline when the CPU lacks it).
pub fn max_pass(isa: Isa, row: &[f32]) -> f32 {
    #[cfg(target_arch = "x86_64")]
    {
        if isa == Isa::Avx512 && isa.available() {
            // SAFETY: the CPU has AVX-512F (checked just above).
            return unsafe { x86::max_avx512(row) };
        }
        if isa == Isa::Avx2 && isa.available() {
            // SAFETY: the CPU has AVX2 and FMA (checked just above).
            return unsafe { x86::max_avx2(row) };
        }
    }
    let _ = isa;
    max_body(row)
}

/// `(max, sum of exp(x - max))` of a finite, non-empty `row` in one pass, compiled for `isa`.
/// The exp is [`exp_approx`] (relative error about 2e-7); the sum is f32 over 32 lanes.
pub fn max_sum_exp_pass(isa: Isa, row: &[f32]) -> (f32, f32) {
    #[cfg(target_arch = "x86_64")]
    {
        if isa == Isa::Avx512 && isa.available() {
            // SAFETY: the CPU has AVX-512F (checked just above).
            return unsafe { x86::sum_exp_avx512(row) };
        }
        if isa == Isa::Avx2 && isa.available() {
            // SAFETY: the CPU has AVX2 and FMA (checked just above).
            return unsafe { x86::sum_exp_avx2(row) };
        }
    }
    let _ = isa;
    sum_exp_body::<false>(row)
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn max_avx512(row: &[f32]) -> f32 {
        super::max_body(row)
    }

    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn max_avx2(row: &[f32]) -> f32 {
        super::max_body(row)
    }

    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn sum_exp_avx512(row: &[f32]) -> (f32, f32) {
        super::sum_exp_body::<true>(row)
    }

    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn sum_exp_avx2(row: &[f32]) -> (f32, f32) {
        super::sum_exp_body::<true>(row)
    }
}

/// `a > b ? a : b`: one max instruction per lane once vectorised (`f32::max` also handles NaN,
/// which costs extra instructions; the rows here are finite).
#[inline(always)]
fn gt_max(a: f32, b: f32) -> f32 {
    if a > b {
        a
    } else {
        b
    }
}

#[inline(always)]
fn max_body(row: &[f32]) -> f32 {
    let mut acc = [f32::NEG_INFINITY; MAX_LANES];
    let chunks = row.chunks_exact(MAX_LANES);
    let rest = chunks.remainder();
    for chunk in chunks {
        for (a, &x) in acc.iter_mut().zip(chunk) {
            *a = gt_max(x, *a);
        }
    }
    let m = rest.iter().fold(f32::NEG_INFINITY, |m, &x| gt_max(x, m));
    acc.iter().fold(m, |m, &a| gt_max(a, m))
}

/// `a * b + c`, fused when `FMA` (only where the CPU has it: elsewhere `mul_add` is a libm call).
#[inline(always)]
fn madd<const FMA: bool>(a: f32, b: f32, c: f32) -> f32 {
    if FMA {
        a.mul_add(b, c)
    } else {
        a * b + c
    }
}

#[inline(always)]
fn sum_exp_body<const FMA: bool>(row: &[f32]) -> (f32, f32) {
    // Per lane: running max and sum of exp(x - running max). f32::MIN, not -inf, so that the
    // first rescale is exp(MIN - m) = 0, never exp(-inf + inf) = NaN.
    let mut m = [f32::MIN; EXP_LANES];
    let mut s = [0.0f32; EXP_LANES];
    let blocks = row.chunks_exact(EXP_BLOCK);
    let rest = blocks.remainder();
    for block in blocks {
        let mut bm = m;
        for chunk in block.chunks_exact(EXP_LANES) {
            for (b, &x) in bm.iter_mut().zip(chunk) {
                *b = gt_max(x, *b);
            }
        }
        for ((si, mi), &b) in s.iter_mut().zip(m.iter_mut()).zip(&bm) {
            *si *= exp_approx_with::<FMA>(*mi - b);
            *mi = b;
        }
        for chunk in block.chunks_exact(EXP_LANES) {
            for ((si, &mi), &x) in s.iter_mut().zip(&m).zip(chunk) {
                *si += exp_approx_with::<FMA>(x - mi);
            }
        }
    }
    let mut max = m.iter().fold(f32::MIN, |a, &b| gt_max(b, a));
    max = rest.iter().fold(max, |a, &b| gt_max(b, a));
    let mut sum = 0.0f32;
    for (&si, &mi) in s.iter().zip(&m) {
        sum += si * exp_approx_with::<FMA>(mi - max);
    }
    for &x in rest {
        sum += exp_approx_with::<FMA>(x - max);
    }
    (max, sum)
}

/// `e^x` in f32 for `x <= 88`, without a libm call so that it vectorises: Cody–Waite range
/// reduction `x = n ln 2 + r` (`n` rounded with the 1.5 * 2^23 trick), Cephes' degree-6
/// polynomial for `e^r` on `|r| <= ln 2 / 2`, and `2^n` built in the exponent bits. Relative
/// error about 2e-7 (a couple of ulps); inputs below -87 give about 1.6e-38 instead of less.
pub fn exp_approx(x: f32) -> f32 {
    exp_approx_with::<false>(x)
}

/// [`exp_approx`], with fused multiply-adds when `FMA`.
#[inline(always)]
fn exp_approx_with<const FMA: bool>(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    const ROUND: f32 = 12_582_912.0; // 1.5 * 2^23
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    let x = if x < -87.0 { -87.0 } else { x };
    let x = if x > 88.0 { 88.0 } else { x };
    let t = madd::<FMA>(x, LOG2E, ROUND);
    let n = t - ROUND;
    let r = madd::<FMA>(-n, LN2_LO, madd::<FMA>(-n, LN2_HI, x));
    let mut p = 1.987_569_2e-4f32;
    p = madd::<FMA>(p, r, 1.398_199_9e-3);
    p = madd::<FMA>(p, r, 8.333_452e-3);
    p = madd::<FMA>(p, r, 4.166_579_6e-2);
    p = madd::<FMA>(p, r, 1.666_666_5e-1);
    p = madd::<FMA>(p, r, 0.5);
    let y = madd::<FMA>(p, r * r, r) + 1.0;
    // t's low mantissa bits hold n + 2^22; n + 127 is the biased exponent of 2^n.
    let bits = (t.to_bits() as i32 - 0x4B40_0000 + 127) << 23;
    y * f32::from_bits(bits as u32)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sampling::workload::Logits;

    const ISAS: [Isa; 3] = [Isa::Baseline, Isa::Avx2, Isa::Avx512];

    #[test]
    fn exp_approx_is_within_a_few_ulps_of_exp() {
        // Both forms: plain multiply-adds (baseline) and fused (the AVX2 / AVX-512 passes).
        for exp in [exp_approx_with::<false>, exp_approx_with::<true>] {
            let mut worst = 0.0f64;
            let mut x = -87.0f32;
            while x <= 88.0 {
                let want = f64::from(x).exp();
                let got = f64::from(exp(x));
                worst = worst.max(((got - want) / want).abs());
                x += 0.001_7;
            }
            assert!(worst < 5e-7, "worst relative error {worst}");
            assert_eq!(exp(0.0), 1.0);
            assert!(exp(f32::NEG_INFINITY) < 1e-37);
        }
    }

    #[test]
    fn floors_compute_max_and_sum_of_exp() {
        let logits = Logits::generate(1, 151_936 + 77, 3);
        for len in [1, 5, 63, 64, 65, 1000, 151_936 + 77] {
            let row = &logits.row(0)[..len];
            let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let sum: f64 = row
                .iter()
                .map(|&x| (f64::from(x) - f64::from(max)).exp())
                .sum();
            for isa in ISAS {
                assert_eq!(max_pass(isa, row), max, "{isa:?} len {len}");
                let (m, s) = max_sum_exp_pass(isa, row);
                assert_eq!(m, max, "{isa:?} len {len}");
                assert!(
                    ((f64::from(s) - sum) / sum).abs() < 1e-5,
                    "{isa:?} len {len}: {s} vs {sum}"
                );
            }
        }
    }
}
