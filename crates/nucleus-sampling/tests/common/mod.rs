//! Shared test support: the f64 oracle of spec/sampling.md, a reference Philox4x32-10, the
//! spec's uniform, inverse-CDF selection and the chi-square critical value; and the helpers
//! that the two halves of the large-row tests ([`large_rows`]) and of the `n` / `logprobs`
//! tests ([`logprobs_n`]) share.
//!
//! Everything here is written from spec/sampling.md alone, never from the implementation.
//! Each test binary uses a different part of it, hence `allow(dead_code)`.

#![allow(dead_code)]

pub mod large_rows;
pub mod logprobs_n;
pub mod oracle;
pub mod stats;

use nucleus_sampling::philox::philox4x32_10;

/// The spec's uniform ("Random streams"), computed from the implementation's
/// `philox4x32_10` words: key = (seed bits 0-31, seed bits 32-63), counter = (position bits
/// 0-31, position bits 32-63, sample_index, 0), `x = (w0 << 32 | w1) >> 11`,
/// `u = (x + 0.5) / 2^53`.
pub fn spec_uniform(seed: u64, position: u64, sample_index: u32) -> f64 {
    let w = philox4x32_10(
        [position as u32, (position >> 32) as u32, sample_index, 0],
        [seed as u32, (seed >> 32) as u32],
    );
    uniform_from_words(w)
}

/// `u = (((w0 << 32 | w1) >> 11) + 0.5) / 2^53`.
pub fn uniform_from_words(w: [u32; 4]) -> f64 {
    let x = ((u64::from(w[0]) << 32) | u64::from(w[1])) >> 11;
    (x as f64 + 0.5) / 9_007_199_254_740_992.0 // 2^53
}

/// A plain reference Philox4x32-10 (Salmon et al. 2011, Random123's `philox4x32_R(10, ...)`),
/// used only to compare the implementation on counters beyond the three known answers. It is
/// itself checked against the known answers in `worked_cases.rs`.
pub fn reference_philox4x32_10(counter: [u32; 4], key: [u32; 2]) -> [u32; 4] {
    const M0: u64 = 0xD251_1F53;
    const M1: u64 = 0xCD9E_8D57;
    const W0: u32 = 0x9E37_79B9;
    const W1: u32 = 0xBB67_AE85;
    let mut c = counter;
    let mut k = key;
    for round in 0..10 {
        if round > 0 {
            k[0] = k[0].wrapping_add(W0);
            k[1] = k[1].wrapping_add(W1);
        }
        let p0 = M0 * u64::from(c[0]);
        let p1 = M1 * u64::from(c[2]);
        let (hi0, lo0) = ((p0 >> 32) as u32, p0 as u32);
        let (hi1, lo1) = ((p1 >> 32) as u32, p1 as u32);
        c = [hi1 ^ c[1] ^ k[0], lo1, hi0 ^ c[3] ^ k[1], lo0];
    }
    c
}

/// Step 11, literally: walk the ids in ascending order accumulating probability in f64; the
/// first id whose cumulative mass exceeds `u` is chosen; if the total stays below `u`, the last
/// id with non-zero probability.
///
/// Returns `None` when `u` lies within `margin` of a cumulative boundary, where an
/// implementation whose probabilities differ from these within tolerance could choose the
/// neighbour.
pub fn inverse_cdf(probs: &[f64], u: f64, margin: f64) -> Option<u32> {
    let mut cum = 0.0f64;
    let mut last = None;
    let mut chosen = None;
    for (i, &p) in probs.iter().enumerate() {
        if p <= 0.0 {
            continue;
        }
        let before = cum;
        cum += p;
        last = Some(i as u32);
        if (before - u).abs() <= margin || (cum - u).abs() <= margin {
            return None;
        }
        if chosen.is_none() && cum > u {
            chosen = Some(i as u32);
        }
    }
    chosen.or(last)
}

/// A small deterministic generator (SplitMix64) for building fixed test rows. Not related to
/// the sampler's stream.
pub struct SplitMix(pub u64);

impl SplitMix {
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in [0, 1).
    pub fn next_f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / 9_007_199_254_740_992.0
    }

    /// Approximately standard normal (sum of 12 uniforms minus 6).
    pub fn normal(&mut self) -> f64 {
        (0..12).map(|_| self.next_f64()).sum::<f64>() - 6.0
    }

    pub fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n
    }
}

/// A row of `n` logits, roughly normal with standard deviation `scale`.
pub fn normal_row(seed: u64, n: usize, scale: f64) -> Vec<f32> {
    let mut g = SplitMix(seed);
    (0..n).map(|_| (g.normal() * scale) as f32).collect()
}

/// `ln p` of each probability, as f32 logits (the spec's probability cases, until the API
/// takes probability input).
pub fn ln_row(probs: &[f64]) -> Vec<f32> {
    probs.iter().map(|p| p.ln() as f32).collect()
}

/// Asserts `got` equals `want` within `tol` per entry, with a readable message.
#[track_caller]
pub fn assert_close(got: &[f64], want: &[f64], tol: f64, what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!(
            (g - w).abs() <= tol,
            "{what}: entry {i}: got {g}, want {w} (tolerance {tol})\n got  {got:?}\n want {want:?}"
        );
    }
}
