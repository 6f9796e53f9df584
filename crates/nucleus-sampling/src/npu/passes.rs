//! The operator's own vectorised passes over a row: the checks of a probability row and of a
//! `q` row (the row errors of `row_status`, spec/npu_top_k_top_p_sample.md), the f64 sum of a
//! row, and the weights pass (every [`exp_weight`](super::exp_weight), their sum and the mass
//! below a few levels, for top-p's stage 2). AVX-512, AVX2 or the baseline is chosen at run
//! time (module `x86`: the `target_feature` bodies); the results are the same bits.

use crate::kernels;

/// Levels of the weights pass (each 16 times the previous one, from 16 times the
/// `(1 - p) Z / V` bound up).
pub(super) const LEVELS: usize = 4;

/// The relative error of the mass below a level: f32 sums of at most [`LEVEL_BLOCK`] / 16
/// terms per lane (below 64 * 2^-24 = 4e-6), then f64; 1e-4 is a wide margin.
pub(super) const LEVEL_SUM_ERROR: f64 = 1e-4;

/// Values per block of the level sums (f32 within a block, f64 across blocks).
const LEVEL_BLOCK: usize = 1024;

/// The first index whose value is NaN, infinite or negative.
pub(super) fn first_invalid_probability(x: &[f32]) -> Option<usize> {
    let ok = |v: f32| (0.0..=f32::MAX).contains(&v);
    let all_ok = match kernels::isa() {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `isa()` reports AVX-512F only when the CPU has it.
        kernels::Isa::Avx512 => unsafe { x86::probs_ok_avx512(x) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `isa()` reports AVX2 only when the CPU has it.
        kernels::Isa::Avx2 => unsafe { x86::probs_ok_avx2(x) },
        kernels::Isa::Baseline => all_lanes(x, ok),
    };
    if all_ok {
        None
    } else {
        x.iter().position(|&v| !ok(v))
    }
}

/// The first index of a `q` row whose value is NaN or negative (`-0.0` is fine).
pub(super) fn first_invalid_q(q: &[f32]) -> Option<usize> {
    let ok = |v: f32| v >= 0.0;
    let all_ok = match kernels::isa() {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `isa()` reports AVX-512F only when the CPU has it.
        kernels::Isa::Avx512 => unsafe { x86::q_ok_avx512(q) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `isa()` reports AVX2 only when the CPU has it.
        kernels::Isa::Avx2 => unsafe { x86::q_ok_avx2(q) },
        kernels::Isa::Baseline => all_lanes(q, ok),
    };
    if all_ok {
        None
    } else {
        q.iter().position(|&v| !ok(v))
    }
}

/// Whether `ok` holds for every value: 16 independent lanes without early exit, which LLVM
/// vectorises.
#[inline(always)]
fn all_lanes(x: &[f32], ok: impl Fn(f32) -> bool) -> bool {
    let mut bad = [0u32; 16];
    let chunks = x.chunks_exact(16);
    let rest = chunks.remainder();
    for c in chunks {
        for (b, &v) in bad.iter_mut().zip(c) {
            *b |= u32::from(!ok(v));
        }
    }
    bad.iter().all(|&b| b == 0) && rest.iter().all(|&v| ok(v))
}

/// The f64 sum of `x` (16 lanes).
pub(super) fn sum_f64(x: &[f32]) -> f64 {
    match kernels::isa() {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `isa()` reports AVX-512F only when the CPU has it.
        kernels::Isa::Avx512 => unsafe { x86::sum_f64_avx512(x) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `isa()` reports AVX2 only when the CPU has it.
        kernels::Isa::Avx2 => unsafe { x86::sum_f64_avx2(x) },
        kernels::Isa::Baseline => sum_f64_body(x),
    }
}

#[inline(always)]
fn sum_f64_body(x: &[f32]) -> f64 {
    let mut acc = [0.0f64; 16];
    let chunks = x.chunks_exact(16);
    let rest = chunks.remainder();
    for c in chunks {
        for (a, &v) in acc.iter_mut().zip(c) {
            *a += f64::from(v);
        }
    }
    acc.iter().sum::<f64>() + rest.iter().map(|&v| f64::from(v)).sum::<f64>()
}

/// Writes `out[i] = exp_weight(x[i], max)` and returns their f64 sum and, with `levels`, the
/// mass of the weights below each level (within [`LEVEL_SUM_ERROR`]), in vectorised passes
/// (the widest instruction set the CPU has; the weights are the same bits on each).
pub(super) fn weights_and_sum(
    x: &[f32],
    max: f32,
    out: &mut [f32],
    levels: Option<&[f32; LEVELS]>,
) -> (f64, Option<[f64; LEVELS]>) {
    match kernels::isa() {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `isa()` reports AVX-512F only when the CPU has it.
        kernels::Isa::Avx512 => unsafe { x86::weights_and_sum_avx512(x, max, out, levels) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `isa()` reports AVX2 only when the CPU has it.
        kernels::Isa::Avx2 => unsafe { x86::weights_and_sum_avx2(x, max, out, levels) },
        kernels::Isa::Baseline => weights_and_sum_body(x, max, out, levels),
    }
}

#[inline(always)]
fn weights_and_sum_body(
    x: &[f32],
    max: f32,
    out: &mut [f32],
    levels: Option<&[f32; LEVELS]>,
) -> (f64, Option<[f64; LEVELS]>) {
    // Separate loops for the exp with its stores and for the sums vectorise best.
    let below = match levels {
        None => {
            for (&v, o) in x.iter().zip(out.iter_mut()) {
                *o = kernels::exp_w(v - max);
            }
            None
        }
        Some(levels) => {
            const L: usize = 16;
            let mut below = [0.0f64; LEVELS];
            for (xb, ob) in x.chunks(LEVEL_BLOCK).zip(out.chunks_mut(LEVEL_BLOCK)) {
                let mut part = [[0.0f32; L]; LEVELS];
                let whole = xb.len() / L * L;
                for (xc, oc) in xb[..whole]
                    .chunks_exact(L)
                    .zip(ob[..whole].chunks_exact_mut(L))
                {
                    for i in 0..L {
                        let w = kernels::exp_w(xc[i] - max);
                        oc[i] = w;
                        for j in 0..LEVELS {
                            part[j][i] += if w < levels[j] { w } else { 0.0 };
                        }
                    }
                }
                for (&v, o) in xb[whole..].iter().zip(&mut ob[whole..]) {
                    *o = kernels::exp_w(v - max);
                    for j in 0..LEVELS {
                        part[j][0] += if *o < levels[j] { *o } else { 0.0 };
                    }
                }
                for j in 0..LEVELS {
                    below[j] += part[j].iter().map(|&v| f64::from(v)).sum::<f64>();
                }
            }
            Some(below)
        }
    };
    (sum_f64_body(out), below)
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn sum_f64_avx512(x: &[f32]) -> f64 {
        super::sum_f64_body(x)
    }

    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn sum_f64_avx2(x: &[f32]) -> f64 {
        super::sum_f64_body(x)
    }

    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn probs_ok_avx512(x: &[f32]) -> bool {
        super::all_lanes(x, |v| (0.0..=f32::MAX).contains(&v))
    }

    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn probs_ok_avx2(x: &[f32]) -> bool {
        super::all_lanes(x, |v| (0.0..=f32::MAX).contains(&v))
    }

    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn q_ok_avx512(q: &[f32]) -> bool {
        super::all_lanes(q, |v| v >= 0.0)
    }

    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn q_ok_avx2(q: &[f32]) -> bool {
        super::all_lanes(q, |v| v >= 0.0)
    }

    use super::LEVELS;

    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn weights_and_sum_avx512(
        x: &[f32],
        max: f32,
        out: &mut [f32],
        levels: Option<&[f32; LEVELS]>,
    ) -> (f64, Option<[f64; LEVELS]>) {
        super::weights_and_sum_body(x, max, out, levels)
    }

    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn weights_and_sum_avx2(
        x: &[f32],
        max: f32,
        out: &mut [f32],
        levels: Option<&[f32; LEVELS]>,
    ) -> (f64, Option<[f64; LEVELS]>) {
        super::weights_and_sum_body(x, max, out, levels)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::npu::exp_weight;

    #[test]
    fn weights_and_sum_gives_exp_weight_bits_on_every_path() {
        let x: Vec<f32> = (0..3037)
            .map(|i| ((i * 7919) % 1009) as f32 * -0.03)
            .chain([f32::NEG_INFINITY, 0.0])
            .collect();
        let levels: [f32; LEVELS] = std::array::from_fn(|j| 1e-6 * 4f32.powi(j as i32 + 1));
        for lv in [None, Some(&levels)] {
            let mut out = vec![0.0; x.len()];
            let mut base = vec![0.0; x.len()];
            let (z, below) = weights_and_sum(&x, 0.0, &mut out, lv);
            let (zb, below_b) = weights_and_sum_body(&x, 0.0, &mut base, lv);
            for (i, &v) in x.iter().enumerate() {
                assert_eq!(out[i].to_bits(), exp_weight(v, 0.0).to_bits(), "{i}");
                assert_eq!(base[i].to_bits(), out[i].to_bits(), "{i}");
            }
            let want: f64 = out.iter().map(|&w| f64::from(w)).sum();
            assert!((z - want).abs() <= 1e-12 * want && (zb - want).abs() <= 1e-12 * want);
            assert_eq!(below.is_some(), lv.is_some());
            if let (Some(below), Some(below_b)) = (below, below_b) {
                for j in 0..LEVELS {
                    let want: f64 = out
                        .iter()
                        .filter(|&&w| w < levels[j])
                        .map(|&w| f64::from(w))
                        .sum();
                    for got in [below[j], below_b[j]] {
                        assert!((got - want).abs() <= LEVEL_SUM_ERROR * want, "level {j}");
                    }
                    assert!(want > 0.0 && want < z, "level {j} is exercised");
                }
            }
        }
    }
}
