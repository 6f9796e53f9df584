//! The forward pass's steps around `exp`, with our own vector `exp`: SwiGLU's `silu(gate) * up`
//! (in place, fused) and attention's causal softmax of scaled scores ([`CausalSoftmax`]).
//!
//! `silu(g) = g / (1 + exp(-g))`, then times `up`: candle's `Silu` formula
//! (`candle-core/src/op.rs`, `Silu::f32`) with its two roundings (the division, then the
//! product). The softmax is `candle_nn::ops::softmax_last_dim`'s (`candle-nn/src/ops.rs`:
//! subtract the row's maximum, `exp`, divide by the sum) of the scores times the scale, over
//! the keys each query may see. On AVX2 `exp` is `x86::exp`, 8 lanes at a time, within 2 ulp
//! of the exact value (tested against f64); elsewhere `f32::exp` (libm's, as candle's). The
//! other differences from candle are the order of the softmax's sum (8 lanes, then halves and
//! pairs, as the matrix kernels reduce) and that masked keys are skipped rather than added as
//! `-inf`.
//!
//! Why ours: in a 256-token Q8_0 prefill of the 0.85 B model, candle's `silu`, `mul`, scaling,
//! mask addition and softmax (a scalar libm `expf` per element, one pass and one allocation
//! per operation) took about a third of the 0.83 s outside the matrix products: 0.83 -> 0.52 s
//! with these two (BENCHMARKS.md, "Prefill overheads (stop 41)").
//!
//! Every element goes through the same arithmetic whatever the length of its row or buffer
//! (the vector paths pad tails rather than finish them in scalar code, and masked keys add
//! nothing to a sum), so a row's result does not depend on the batch it runs in.

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp1, Layout, Shape};

/// `gate[i] = silu(gate[i]) * up[i]` for every `i` (the module docs' formula): `gate` and
/// `up` f32 of the same length (`[T, inter]` row-major, or any shape: the operation is
/// elementwise). NaN in either gives NaN; `gate = +inf` gives `inf * up`, `-inf` NaN (as
/// candle: `-inf / inf`).
///
/// # Panics
/// When the lengths differ (a caller's bug: both come from the same block's products).
pub(crate) fn silu_mul(gate: &mut [f32], up: &[f32]) {
    assert_eq!(gate.len(), up.len(), "silu_mul: gate and up of one length");
    #[cfg(target_arch = "x86_64")]
    if crate::models::matmul::avx2() {
        // SAFETY: the CPU has AVX2, FMA and F16C (`avx2`).
        return unsafe { x86::silu_mul(gate, up) };
    }
    silu_mul_portable(gate, up);
}

/// [`silu_mul`] with `f32::exp`: candle's `Silu::f32`, then the product.
fn silu_mul_portable(gate: &mut [f32], up: &[f32]) {
    for (g, &u) in gate.iter_mut().zip(up) {
        *g = *g / (1.0 + (-*g).exp()) * u;
    }
}

/// Attention's causal softmax as a candle operation on scores `[.., rows_total, kv]` (f32,
/// contiguous; each row one query against `kv` keys): row `ρ` (counting over all leading
/// dimensions) is query `ρ % rows` of a block whose first query sees keys `0..first_visible`,
/// so it sees `min(kv, first_visible + ρ % rows)` keys; out: `softmax(score * scale)` over
/// those, 0 for the keys after. The grouped-query layout `[n_kv, n_rep * rows, kv]` (each kv
/// head's `n_rep` query heads one after another, `rows` queries each) gives every query its
/// own row this way. Decode is one row that sees all `kv` keys (`rows` 1, `first_visible`
/// `kv`). See the module docs for the arithmetic. The scores of keys a query does not see are
/// not read: a NaN or inf there does not reach its row (a mask added as -inf let it, as NaN).
/// Any `scale` works, 0 and negative included.
#[derive(Debug, Clone, Copy)]
pub(crate) struct CausalSoftmax {
    /// The factor of the scores before the softmax (`1 / sqrt(head_dim)`).
    pub scale: f32,
    /// The queries of the block (rows of each head), at least 1.
    pub rows: usize,
    /// The keys the block's first query sees (its position + 1), at least 1.
    pub first_visible: usize,
}

impl CustomOp1 for CausalSoftmax {
    fn name(&self) -> &'static str {
        "nucleus-causal-softmax"
    }

    fn cpu_fwd(
        &self,
        storage: &CpuStorage,
        layout: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let CpuStorage::F32(src) = storage else {
            candle_core::bail!("causal softmax: f32 scores, not {:?}", storage.dtype());
        };
        let Some((start, end)) = layout.contiguous_offsets() else {
            candle_core::bail!("causal softmax: contiguous scores");
        };
        let (rows, first) = (self.rows.max(1), self.first_visible.max(1));
        let kv = layout.shape().dims().last().copied().unwrap_or(1);
        let src = &src[start..end];
        let mut dst = vec![0f32; src.len()];
        if kv > 0 {
            let row = |(r, (s, d)): (usize, (&[f32], &mut [f32]))| {
                let visible = kv.min(first + r % rows);
                softmax_row(&s[..visible], &mut d[..visible], self.scale);
            };
            // Rows are independent: on rayon's pool (as candle's softmax) the bits are the same.
            if rayon::current_num_threads() > 1 && src.len() >= PARALLEL_SCORES {
                use rayon::prelude::*;
                src.par_chunks_exact(kv)
                    .zip(dst.par_chunks_exact_mut(kv))
                    .enumerate()
                    .for_each(row);
            } else {
                src.chunks_exact(kv)
                    .zip(dst.chunks_exact_mut(kv))
                    .enumerate()
                    .for_each(row);
            }
        }
        Ok((CpuStorage::F32(dst), layout.shape().clone()))
    }
}

/// The fewest scores for which [`CausalSoftmax`] splits its rows over rayon's pool.
const PARALLEL_SCORES: usize = 1 << 14;

/// `d = softmax(s * scale)` ([`CausalSoftmax`]); `s` and `d` of one length.
fn softmax_row(s: &[f32], d: &mut [f32], scale: f32) {
    // A real check: the AVX2 path writes `d` through pointers up to `s.len()`.
    assert_eq!(
        s.len(),
        d.len(),
        "softmax_row: scores and weights of one length"
    );
    #[cfg(target_arch = "x86_64")]
    if crate::models::matmul::avx2() {
        // SAFETY: the CPU has AVX2, FMA and F16C (`avx2`).
        return unsafe { x86::softmax_row(s, d, scale) };
    }
    softmax_row_portable(s, d, scale);
}

/// [`softmax_row`] with `f32::exp`; the sum in `LANES` lanes (element `j` in lane `j % 8`),
/// reduced as `matmul::reduce`, the same order as the AVX2 path.
fn softmax_row_portable(s: &[f32], d: &mut [f32], scale: f32) {
    use crate::models::matmul::{reduce, LANES};
    // f32::max skips NaNs, as `_mm256_max_ps(x, m)` does.
    let m = s.iter().fold(f32::NEG_INFINITY, |m, &v| (v * scale).max(m));
    let mut lanes = [0f32; LANES];
    for (j, (&v, d)) in s.iter().zip(d.iter_mut()).enumerate() {
        *d = (v * scale - m).exp();
        lanes[j % LANES] += *d;
    }
    let sum = reduce(&lanes);
    d.iter_mut().for_each(|d| *d /= sum);
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    /// `exp(z)` in 8 lanes: `z = n ln 2 + r` with `n = round(z / ln 2)`, `|r| <= ln 2 / 2`
    /// (`ln 2` in two parts, Cody-Waite), `exp(r)` by Cephes' `expf` polynomial (degree 7),
    /// then times `2^n` as two powers of two `2^a · 2^b`, `a + b = n`, each a normal f32, so
    /// the only rounding of the scaling is the last product: overflow gives +inf (`z >
    /// ln(f32::MAX)`), underflow rounds into the subnormals and to +0. `z` is clamped to
    /// `[-104, 89]` first (beyond, the result is 0 or inf anyway); NaN stays NaN (the clamps'
    /// operands are ordered so that a NaN `z` passes through).
    ///
    /// # Safety
    /// The CPU has AVX2 and FMA.
    #[inline(always)]
    pub(super) unsafe fn exp(z: __m256) -> __m256 {
        // max / min return their second operand when either is NaN: `z` second keeps a NaN.
        let x = _mm256_min_ps(
            _mm256_set1_ps(89.0),
            _mm256_max_ps(_mm256_set1_ps(-104.0), z),
        );
        let n = _mm256_round_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(
            _mm256_mul_ps(x, _mm256_set1_ps(std::f32::consts::LOG2_E)),
        );
        // ln 2 = 0.693359375 - 2.12194440e-4 (the first part exact in 9 bits, so n times it is
        // exact for |n| <= 150).
        let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693_359_4), x);
        let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.121_944_4e-4), r);
        let mut p = _mm256_set1_ps(1.987_569_1e-4);
        for c in [
            1.398_199_9e-3,
            8.333_452e-3,
            4.166_579_6e-2,
            0.166_666_65,
            0.5,
        ] {
            p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(c));
        }
        // 1 + r + r^2 p(r)
        let r2 = _mm256_mul_ps(r, r);
        let e = _mm256_add_ps(_mm256_fmadd_ps(p, r2, r), _mm256_set1_ps(1.0));
        // n in [-150, 128]: a = n >> 1 and b = n - a in [-75, 64], normal exponents.
        let ni = _mm256_cvtps_epi32(n);
        let a = _mm256_srai_epi32::<1>(ni);
        let b = _mm256_sub_epi32(ni, a);
        let bias = _mm256_set1_epi32(127);
        let pa = _mm256_castsi256_ps(_mm256_slli_epi32::<23>(_mm256_add_epi32(a, bias)));
        let pb = _mm256_castsi256_ps(_mm256_slli_epi32::<23>(_mm256_add_epi32(b, bias)));
        _mm256_mul_ps(_mm256_mul_ps(e, pa), pb)
    }

    /// `g / (1 + exp(-g)) * u` in 8 lanes.
    #[inline(always)]
    unsafe fn silu_mul8(g: __m256, u: __m256) -> __m256 {
        let e = exp(_mm256_xor_ps(g, _mm256_set1_ps(-0.0)));
        _mm256_mul_ps(_mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.0), e)), u)
    }

    /// `super::silu_mul` on AVX2; the last `len % 8` elements through the same lanes, padded.
    ///
    /// # Safety
    /// The CPU has AVX2 and FMA; `gate.len() == up.len()`.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn silu_mul(gate: &mut [f32], up: &[f32]) {
        debug_assert_eq!(gate.len(), up.len());
        let mut gs = gate.chunks_exact_mut(8);
        let mut us = up.chunks_exact(8);
        for (g, u) in (&mut gs).zip(&mut us) {
            let y = silu_mul8(_mm256_loadu_ps(g.as_ptr()), _mm256_loadu_ps(u.as_ptr()));
            _mm256_storeu_ps(g.as_mut_ptr(), y);
        }
        let (g, u) = (gs.into_remainder(), us.remainder());
        if !g.is_empty() {
            let (mut gb, mut ub) = ([0f32; 8], [0f32; 8]);
            gb[..g.len()].copy_from_slice(g);
            ub[..u.len()].copy_from_slice(u);
            let y = silu_mul8(_mm256_loadu_ps(gb.as_ptr()), _mm256_loadu_ps(ub.as_ptr()));
            _mm256_storeu_ps(gb.as_mut_ptr(), y);
            let n = g.len();
            g.copy_from_slice(&gb[..n]);
        }
    }

    /// `super::softmax_row` on AVX2: the maximum, then `exp(s * scale - max)` stored and summed
    /// in 8 lanes, then each divided by the sum; the tail padded with `-inf` (`exp` 0).
    ///
    /// # Safety
    /// The CPU has AVX2 and FMA; `s.len() == d.len()`.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn softmax_row(s: &[f32], d: &mut [f32], scale: f32) {
        let n = s.len();
        let body = n - n % 8;
        let sc = _mm256_set1_ps(scale);
        // The tail's scaled scores (the same f32 products as the vector `vmulps`), padded with
        // -inf after scaling: padding first would turn into NaN (scale 0) or +inf (scale < 0).
        let mut tail_x = [f32::NEG_INFINITY; 8];
        for (x, &v) in tail_x.iter_mut().zip(&s[body..]) {
            *x = v * scale;
        }
        // max(x, m) keeps m when x is NaN (the second operand on unordered), as f32::max.
        let mut m8 = _mm256_set1_ps(f32::NEG_INFINITY);
        for j in (0..body).step_by(8) {
            m8 = _mm256_max_ps(_mm256_mul_ps(_mm256_loadu_ps(s.as_ptr().add(j)), sc), m8);
        }
        if body < n {
            m8 = _mm256_max_ps(_mm256_loadu_ps(tail_x.as_ptr()), m8);
        }
        let mut mm = [0f32; 8];
        _mm256_storeu_ps(mm.as_mut_ptr(), m8);
        let m = mm.iter().fold(f32::NEG_INFINITY, |a, &b| b.max(a));
        let mv = _mm256_set1_ps(m);
        let mut sum8 = _mm256_setzero_ps();
        for j in (0..body).step_by(8) {
            let x = _mm256_sub_ps(_mm256_mul_ps(_mm256_loadu_ps(s.as_ptr().add(j)), sc), mv);
            let e = exp(x);
            _mm256_storeu_ps(d.as_mut_ptr().add(j), e);
            sum8 = _mm256_add_ps(sum8, e);
        }
        let mut tail_d = [0f32; 8];
        if body < n {
            let x = _mm256_sub_ps(_mm256_loadu_ps(tail_x.as_ptr()), mv);
            let e = exp(x);
            _mm256_storeu_ps(tail_d.as_mut_ptr(), e);
            sum8 = _mm256_add_ps(sum8, e);
        }
        let sum = _mm256_set1_ps(crate::models::matmul::x86::finish(sum8, 0.0));
        for j in (0..body).step_by(8) {
            let p = d.as_mut_ptr().add(j);
            _mm256_storeu_ps(p, _mm256_div_ps(_mm256_loadu_ps(p), sum));
        }
        if body < n {
            let e = _mm256_div_ps(_mm256_loadu_ps(tail_d.as_ptr()), sum);
            _mm256_storeu_ps(tail_d.as_mut_ptr(), e);
            d[body..].copy_from_slice(&tail_d[..n - body]);
        }
    }

    #[cfg(test)]
    pub(super) fn exp_lanes(z: [f32; 8]) -> [f32; 8] {
        assert!(
            crate::models::matmul::avx2(),
            "exp_lanes needs AVX2 and FMA"
        );
        let mut out = [0f32; 8];
        // SAFETY: the CPU has AVX2 and FMA (asserted above).
        unsafe {
            #[target_feature(enable = "avx2,fma")]
            unsafe fn run(z: &[f32; 8], out: &mut [f32; 8]) {
                _mm256_storeu_ps(out.as_mut_ptr(), exp(_mm256_loadu_ps(z.as_ptr())));
            }
            run(&z, &mut out);
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, Tensor};

    /// Units in the last place between `a` and the f32 nearest to `exact` (0 when both are
    /// the same infinity or both NaN), on the f32 grid.
    fn ulps(a: f32, exact: f64) -> f64 {
        let e = exact as f32;
        if a.is_nan() || e.is_nan() {
            return if a.is_nan() && e.is_nan() {
                0.0
            } else {
                f64::INFINITY
            };
        }
        if a == e {
            return 0.0;
        }
        if a.is_infinite() || e.is_infinite() {
            return f64::INFINITY;
        }
        (a as f64 - exact).abs() / spacing(e)
    }

    /// The distance from finite `e` to the next f32 away from zero (its ulp; the subnormal
    /// step below the normals; below `f32::MAX`'s the step under it).
    fn spacing(e: f32) -> f64 {
        let a = e.abs();
        let up = a.next_up();
        if up.is_finite() {
            (up as f64) - (a as f64)
        } else {
            (a as f64) - (a.next_down() as f64)
        }
    }

    fn xorshift(s: &mut u64) -> u64 {
        *s ^= *s << 13;
        *s ^= *s >> 7;
        *s ^= *s << 17;
        *s
    }

    #[cfg(target_arch = "x86_64")]
    #[test]
    fn the_vector_exp_is_within_2_ulp_of_f64_and_keeps_its_edges() {
        if !crate::models::matmul::avx2() {
            return;
        }
        // A sweep of the whole finite range that matters, and random arguments.
        let mut zs: Vec<f32> = (0..=400_000)
            .map(|i| -104.0 + 193.0 * i as f32 / 400_000.0)
            .collect();
        let mut s = 0x9E37_79B9_7F4A_7C15u64;
        zs.extend((0..100_000).map(|_| {
            let u = (xorshift(&mut s) >> 40) as f32 / (1u64 << 24) as f32;
            -20.0 + 40.0 * u
        }));
        let mut worst = 0f64;
        for c in zs.chunks(8) {
            let mut z = [0f32; 8];
            z[..c.len()].copy_from_slice(c);
            let e = x86::exp_lanes(z);
            for (&zi, &ei) in z.iter().zip(&e) {
                let exact = (zi as f64).exp();
                // Below the normals the spacing is absolute: 2 subnormal steps.
                let u = ulps(ei, exact);
                assert!(u <= 2.0, "exp({zi:e}) = {ei:e}, exact {exact:e}: {u} ulp");
                worst = worst.max(u);
            }
        }
        assert!(
            worst > 0.0,
            "a comparison that never differs compares nothing"
        );
        let edges = [
            0.0,
            -0.0,
            1.0,
            88.72283,
            89.0,
            1e6,
            f32::INFINITY,
            -87.33655,
            -103.0,
            -104.0,
            -1e6,
            f32::NEG_INFINITY,
            f32::NAN,
        ];
        for c in edges.chunks(8) {
            let mut z = [0f32; 8];
            z[..c.len()].copy_from_slice(c);
            for (&zi, &ei) in z.iter().zip(&x86::exp_lanes(z)) {
                let exact = (zi as f64).exp();
                assert!(
                    ulps(ei, exact) <= 2.0,
                    "exp({zi:e}) = {ei:e}, exact {exact:e}"
                );
            }
        }
        assert_eq!(x86::exp_lanes([0.0; 8])[0], 1.0);
        assert_eq!(x86::exp_lanes([f32::INFINITY; 8])[0], f32::INFINITY);
        assert_eq!(x86::exp_lanes([f32::NEG_INFINITY; 8])[0].to_bits(), 0);
        assert!(x86::exp_lanes([f32::NAN; 8])[0].is_nan());
    }

    /// silu(g) * u in f64 from the f32 inputs.
    fn reference(g: f32, u: f32) -> f64 {
        let g = g as f64;
        g / (1.0 + (-g).exp()) * u as f64
    }

    fn inputs(n: usize, seed: u64) -> (Vec<f32>, Vec<f32>) {
        let mut s = seed | 1;
        let mut v = || {
            let u = (xorshift(&mut s) >> 40) as f32 / (1u64 << 24) as f32;
            -30.0 + 60.0 * u
        };
        let g: Vec<f32> = (0..n).map(|_| v()).collect();
        let u: Vec<f32> = (0..n).map(|_| v() / 10.0).collect();
        (g, u)
    }

    #[test]
    fn silu_mul_is_within_4_ulp_of_f64_on_every_length() {
        // Each rounding (exp, 1 + e, the division, the product) adds at most about one ulp.
        for n in (0..40).chain([1000, 5632 + 3]) {
            let (g, u) = inputs(n, n as u64 + 7);
            let mut y = g.clone();
            silu_mul(&mut y, &u);
            let mut p = g.clone();
            silu_mul_portable(&mut p, &u);
            for i in 0..n {
                let exact = reference(g[i], u[i]);
                assert!(
                    ulps(y[i], exact) <= 4.0,
                    "n {n}, i {i}: silu({}) * {} = {}, exact {exact:e}",
                    g[i],
                    u[i],
                    y[i]
                );
                assert!(ulps(p[i], exact) <= 4.0, "portable, n {n}, i {i}");
            }
        }
    }

    #[test]
    fn silu_mul_is_candles_silu_times_up_within_4_ulp_and_keeps_its_edges() {
        let mut g = vec![
            0.0,
            -0.0,
            1.0,
            -1.0,
            88.0,
            -88.0,
            89.0,
            -89.0,
            104.0,
            -104.0,
            1e30,
            -1e30,
            f32::MAX,
            f32::MIN,
            f32::INFINITY,
            f32::NEG_INFINITY,
            f32::NAN,
            1e-40,
            -1e-40,
        ];
        let n = g.len();
        let (mut rg, ru) = inputs(1000, 3);
        g.append(&mut rg);
        let mut u: Vec<f32> = vec![1.5; n];
        u.extend(ru);
        let dev = Device::Cpu;
        let gt = Tensor::from_slice(&g, g.len(), &dev).unwrap();
        let ut = Tensor::from_slice(&u, u.len(), &dev).unwrap();
        let candle = (candle_nn::ops::silu(&gt).unwrap() * ut)
            .unwrap()
            .to_vec1::<f32>()
            .unwrap();
        let mut y = g.clone();
        silu_mul(&mut y, &u);
        for i in 0..g.len() {
            let (a, c) = (y[i], candle[i]);
            let same_class = (a.is_nan() && c.is_nan()) || a == c || {
                let d = (a as f64 - c as f64).abs();
                a.is_finite() && c.is_finite() && d <= 4.0 * spacing(c)
            };
            assert!(same_class, "silu({}) * {}: {a:e}, candle {c:e}", g[i], u[i]);
        }
        // The edges' values themselves.
        assert!(y[16].is_nan(), "NaN gate");
        assert!(y[15].is_nan(), "-inf gate: -inf / inf");
        assert_eq!(y[14], f32::INFINITY, "+inf gate");
        assert_eq!(
            y[9].to_bits(),
            (-0.0f32).to_bits(),
            "silu(-104) underflows to -0"
        );
        assert_eq!(y[8], 104.0 * 1.5);
    }

    #[test]
    fn a_row_gives_the_same_bits_alone_and_inside_a_longer_buffer() {
        // Batch invariance: element i's arithmetic does not depend on where the buffer ends.
        let (g, u) = inputs(8 * 5 + 3, 11);
        let mut whole = g.clone();
        silu_mul(&mut whole, &u);
        for start in 0..g.len() {
            for end in start..=g.len() {
                let mut part = g[start..end].to_vec();
                silu_mul(&mut part, &u[start..end]);
                assert!(
                    part.iter()
                        .zip(&whole[start..end])
                        .all(|(a, b)| a.to_bits() == b.to_bits()),
                    "{start}..{end}"
                );
            }
        }
    }

    /// The f64 causal softmax of `[heads, rows, kv]` scores: row `i` of each head sees
    /// `min(kv, first + i)` keys.
    fn softmax_reference(s: &[f32], rows: usize, kv: usize, first: usize, scale: f32) -> Vec<f64> {
        let mut out = vec![0f64; s.len()];
        for (r, (s, o)) in s.chunks(kv).zip(out.chunks_mut(kv)).enumerate() {
            let vis = kv.min(first + r % rows);
            // The scaled scores and their differences from the maximum in f32 (the operation's
            // first two roundings, inherent to any f32 softmax: a difference of 20 is off by
            // up to 1e-6, which exp turns into a relative error of 1e-6), then exact.
            let x: Vec<f32> = s[..vis].iter().map(|&v| v * scale).collect();
            let m = x.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
            let e: Vec<f64> = x.iter().map(|&v| ((v - m) as f64).exp()).collect();
            let sum: f64 = e.iter().sum();
            for (o, e) in o.iter_mut().zip(&e) {
                *o = e / sum;
            }
        }
        out
    }

    /// One query row `s` that sees its first `visible` keys.
    fn one_row(s: &[f32], scale: f32, visible: usize) -> Vec<f32> {
        let op = CausalSoftmax {
            scale,
            rows: 1,
            first_visible: visible,
        };
        causal_softmax(s, &[1, 1, s.len()], op)
    }

    fn causal_softmax(s: &[f32], dims: &[usize], op: CausalSoftmax) -> Vec<f32> {
        let t = Tensor::from_slice(s, dims, &Device::Cpu).unwrap();
        t.apply_op1_no_bwd(&op)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1::<f32>()
            .unwrap()
    }

    #[test]
    fn the_causal_softmax_is_within_8_ulp_of_f64_with_zeros_after_each_querys_keys() {
        // Grouped-query blocks [n_kv, n_rep * rows, kv] of several shapes: tails of every
        // length, a block that starts after cached keys, decode (one row sees all).
        for &(n_kv, n_rep, rows, past, start) in &[
            (2, 2, 5, 0, 0),
            (1, 3, 7, 4, 3),
            (2, 1, 1, 20, 0),
            (1, 1, 19, 0, 0),
            (3, 2, 4, 9, 12),
        ] {
            let kv = past + start + rows;
            let n = n_kv * n_rep * rows * kv;
            let (g, _) = inputs(n, (kv * 31 + rows) as u64);
            let scale = 0.125f32;
            let op = CausalSoftmax {
                scale,
                rows,
                first_visible: past + start + 1,
            };
            let y = causal_softmax(&g, &[n_kv, n_rep * rows, kv], op);
            let exact = softmax_reference(&g, rows, kv, past + start + 1, scale);
            for (i, (&a, &e)) in y.iter().zip(&exact).enumerate() {
                let vis = kv.min(past + start + 1 + (i / kv) % rows);
                if i % kv >= vis {
                    assert_eq!(a.to_bits(), 0, "a masked key has weight +0 ({i})");
                } else {
                    assert!(ulps(a, e) <= 8.0, "{i}: {a:e}, exact {e:e}");
                }
            }
            // Each row sums to 1 within f32 rounding.
            for row in y.chunks(kv) {
                let s: f64 = row.iter().map(|&v| v as f64).sum();
                assert!((s - 1.0).abs() < 1e-5, "a row sums to {s}");
            }
        }
    }

    #[test]
    fn the_causal_softmax_matches_candles_scaled_masked_softmax_within_8_ulp() {
        let (rows, kv, first) = (6, 13, 8);
        let (g, _) = inputs(2 * rows * kv, 5);
        let dev = Device::Cpu;
        let scale = 0.3f32;
        let mask: Vec<f32> = (0..rows)
            .flat_map(|i| {
                (0..kv).map(move |j| {
                    if j < first + i {
                        0.0
                    } else {
                        f32::NEG_INFINITY
                    }
                })
            })
            .collect();
        let t = Tensor::from_slice(&g, (2, rows, kv), &dev).unwrap();
        let mask = Tensor::from_slice(&mask, (rows, kv), &dev).unwrap();
        let candle = candle_nn::ops::softmax_last_dim(
            &(t * scale as f64).unwrap().broadcast_add(&mask).unwrap(),
        )
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1::<f32>()
        .unwrap();
        let ours = causal_softmax(
            &g,
            &[2, rows, kv],
            CausalSoftmax {
                scale,
                rows,
                first_visible: first,
            },
        );
        for (i, (&a, &c)) in ours.iter().zip(&candle).enumerate() {
            assert!(ulps(a, c as f64) <= 8.0, "{i}: {a:e}, candle {c:e}");
        }
    }

    #[test]
    fn a_querys_weights_do_not_depend_on_its_block_or_the_keys_it_cannot_see() {
        // Query at position p (seeing p + 1 keys) in a block of 1 row with exactly its keys,
        // and in a bigger block with more keys: the same bits (batch invariance of prefill).
        let (rows, kv) = (9, 9 + 17);
        let (g, _) = inputs(rows * kv, 9);
        let op = CausalSoftmax {
            scale: 0.7,
            rows,
            first_visible: 18,
        };
        let block = causal_softmax(&g, &[1, rows, kv], op);
        for i in 0..rows {
            let vis = 18 + i;
            let alone = one_row(&g[i * kv..i * kv + vis], 0.7, vis);
            let same = alone
                .iter()
                .zip(&block[i * kv..i * kv + vis])
                .all(|(a, b)| a.to_bits() == b.to_bits());
            assert!(same, "query {i}");
        }
    }

    #[test]
    fn the_portable_softmax_is_within_8_ulp_of_f64_and_nan_scores_give_nan_rows() {
        for n in 1..30 {
            let (g, _) = inputs(n, n as u64);
            let mut d = vec![0f32; n];
            softmax_row_portable(&g, &mut d, 0.5);
            let exact = softmax_reference(&g, 1, n, n, 0.5);
            for (&a, &e) in d.iter().zip(&exact) {
                assert!(ulps(a, e) <= 8.0, "n {n}: {a:e}, exact {e:e}");
            }
        }
        let s = [1.0, f32::NAN, 2.0];
        let y = one_row(&s, 1.0, 3);
        assert!(y.iter().all(|v| v.is_nan()), "{y:?}");
    }

    #[test]
    fn any_scale_and_what_a_query_cannot_see_leave_its_row_finite() {
        // Zero and negative scales (tails of every length; the padding must not turn into NaN
        // or +inf), and NaN / inf scores on keys after the query's, against the f64 softmax.
        for &scale in &[0.0f32, -0.5, 0.25] {
            for kv in 1..20 {
                let (g, _) = inputs(kv, kv as u64 * 3);
                let y = one_row(&g, scale, kv);
                let exact = softmax_reference(&g, 1, kv, kv, scale);
                for (&a, &e) in y.iter().zip(&exact) {
                    assert!(
                        ulps(a, e) <= 8.0,
                        "scale {scale}, kv {kv}: {a:e}, exact {e:e}"
                    );
                }
            }
        }
        let s = [0.5, 1.0, f32::NAN, f32::INFINITY, 2.0];
        let y = one_row(&s, 1.0, 2);
        let exact = softmax_reference(&s, 1, 5, 2, 1.0);
        assert!(
            ulps(y[0], exact[0]) <= 8.0 && ulps(y[1], exact[1]) <= 8.0,
            "{y:?}"
        );
        assert_eq!(&y[2..], &[0.0; 3]);
    }
}
