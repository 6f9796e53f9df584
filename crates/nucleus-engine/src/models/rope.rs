//! Rotary position embeddings: the inverse frequencies of each family's `rope_type`, and the two
//! layouts a head's values can be paired in.
//!
//! A head of `head_dim` values is rotated as `head_dim / 2` pairs; pair `i` turns by the angle
//! `position * inv_freq[i]`, and for YaRN the cosine and sine are also multiplied by an
//! attention factor. The inverse frequencies follow Hugging Face transformers'
//! `src/transformers/modeling_rope_utils.py` (`_compute_default_rope_parameters`,
//! `_compute_linear_scaling_rope_parameters`, `_compute_llama3_parameters`,
//! `_compute_yarn_parameters`), computed in f64 and rounded to f32 once.

use crate::error::{EngineError, Result};

/// How the values of a head are paired for rotation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RopeLayout {
    /// Pair `i` is `(x[2i], x[2i + 1])`: llama.cpp's "normal" RoPE, as GGUF stores the q/k
    /// weights of arch `llama` (its converter permutes Hugging Face's layout into this one);
    /// `candle_nn::rotary_emb::rope_i`.
    Interleaved,
    /// Pair `i` is `(x[i], x[i + head_dim / 2])`: transformers' `rotate_half`, as Hugging Face
    /// checkpoints (and GGUF arch `qwen2` / `qwen3`, llama.cpp's "neox" RoPE) store them;
    /// `candle_nn::rotary_emb::rope`.
    RotateHalf,
}

/// The `rope_scaling` (transformers 4) or `rope_parameters` (transformers 5) of a model.
#[derive(Debug, Clone, PartialEq)]
pub enum RopeScaling {
    /// `rope_type: "default"` or none: `inv_freq[i] = theta^(-2i / head_dim)`.
    None,
    /// `rope_type: "linear"` (and GGUF `rope.scaling.type = linear`): every frequency divided by
    /// `factor`.
    Linear {
        /// The divisor, > 0.
        factor: f64,
    },
    /// `rope_type: "llama3"` (Llama 3.1 and later): long wavelengths divided by `factor`, short
    /// ones kept, the band between interpolated smoothly.
    Llama3 {
        /// `factor` (8 for Llama 3.1).
        factor: f64,
        /// `low_freq_factor` (1).
        low_freq_factor: f64,
        /// `high_freq_factor` (4).
        high_freq_factor: f64,
        /// `original_max_position_embeddings` (8192).
        original_max_position_embeddings: f64,
    },
    /// `rope_type: "yarn"` (Qwen2.5 / Qwen3 long context): NTK-by-parts interpolation between
    /// `theta^(-2i/d)` and the same divided by `factor`, over the dimensions between the
    /// correction range of `beta_fast` and `beta_slow` rotations, and cos / sin scaled by the
    /// attention factor.
    Yarn {
        /// `factor`.
        factor: f64,
        /// `original_max_position_embeddings` (default: `max_position_embeddings`).
        original_max_position_embeddings: f64,
        /// `beta_fast` (default 32).
        beta_fast: f64,
        /// `beta_slow` (default 1).
        beta_slow: f64,
        /// `attention_factor`, else `mscale(factor, mscale) / mscale(factor, mscale_all_dim)`
        /// when both are given, else `0.1 ln(factor) + 1` (1 for `factor <= 1`).
        attention_factor: f64,
        /// `truncate` (default true): the correction range is rounded outwards to whole
        /// dimensions.
        truncate: bool,
    },
}

/// Everything that fixes the rotary embedding of a model.
#[derive(Debug, Clone, PartialEq)]
pub struct RopeConfig {
    /// The base `theta` (`rope_theta`, GGUF `rope.freq_base`), > 0.
    pub theta: f64,
    /// How values are paired.
    pub layout: RopeLayout,
    /// The frequency scaling.
    pub scaling: RopeScaling,
    /// GGUF's optional `rope_freqs.weight`: pair `i`'s frequency is divided by entry `i`
    /// (llama.cpp's `freq_factors`); `head_dim / 2` values.
    pub freq_factors: Option<Vec<f32>>,
}

impl RopeConfig {
    /// Unscaled RoPE with base `theta` in `layout`.
    pub fn new(theta: f64, layout: RopeLayout) -> Self {
        Self {
            theta,
            layout,
            scaling: RopeScaling::None,
            freq_factors: None,
        }
    }

    /// The inverse frequency of each of the `head_dim / 2` pairs and the factor cos and sin are
    /// multiplied by (1 except for YaRN).
    ///
    /// # Errors
    /// [`EngineError::InvalidRequest`] (an internal misuse) when `head_dim` is odd or zero, or
    /// `freq_factors` does not have `head_dim / 2` entries.
    pub fn inv_freq(&self, head_dim: usize) -> Result<(Vec<f32>, f64)> {
        if head_dim == 0 || !head_dim.is_multiple_of(2) {
            return Err(EngineError::InvalidRequest(format!(
                "RoPE over an odd or zero head dimension {head_dim}"
            )));
        }
        let dim = head_dim as f64;
        let base: Vec<f64> = (0..head_dim / 2)
            .map(|i| 1.0 / self.theta.powf((2 * i) as f64 / dim))
            .collect();
        let (freqs, attention_factor): (Vec<f64>, f64) = match &self.scaling {
            RopeScaling::None => (base, 1.0),
            RopeScaling::Linear { factor } => (base.iter().map(|f| f / factor).collect(), 1.0),
            RopeScaling::Llama3 {
                factor,
                low_freq_factor,
                high_freq_factor,
                original_max_position_embeddings: old,
            } => {
                let low_freq_wavelen = old / low_freq_factor;
                let high_freq_wavelen = old / high_freq_factor;
                let freqs = base
                    .iter()
                    .map(|&f| {
                        let wavelen = 2.0 * std::f64::consts::PI / f;
                        if wavelen < high_freq_wavelen {
                            f
                        } else if wavelen > low_freq_wavelen {
                            f / factor
                        } else {
                            let smooth = (old / wavelen - low_freq_factor)
                                / (high_freq_factor - low_freq_factor);
                            (1.0 - smooth) * f / factor + smooth * f
                        }
                    })
                    .collect();
                (freqs, 1.0)
            }
            RopeScaling::Yarn {
                factor,
                original_max_position_embeddings: orig,
                beta_fast,
                beta_slow,
                attention_factor,
                truncate,
            } => {
                let correction_dim = |rotations: f64| {
                    dim * (orig / (rotations * 2.0 * std::f64::consts::PI)).ln()
                        / (2.0 * self.theta.ln())
                };
                let (mut low, mut high) = (correction_dim(*beta_fast), correction_dim(*beta_slow));
                if *truncate {
                    low = low.floor();
                    high = high.ceil();
                }
                let low = low.max(0.0);
                let high = high.min(dim - 1.0);
                let high = if low == high { high + 0.001 } else { high };
                let freqs = base
                    .iter()
                    .enumerate()
                    .map(|(i, &extrapolation)| {
                        let interpolation = extrapolation / factor;
                        let ramp = ((i as f64 - low) / (high - low)).clamp(0.0, 1.0);
                        let extrapolation_factor = 1.0 - ramp;
                        interpolation * (1.0 - extrapolation_factor)
                            + extrapolation * extrapolation_factor
                    })
                    .collect();
                (freqs, *attention_factor)
            }
        };
        let freqs = match &self.freq_factors {
            None => freqs,
            Some(factors) => {
                if factors.len() != head_dim / 2 {
                    return Err(EngineError::InvalidRequest(format!(
                        "{} RoPE frequency factors for {} pairs",
                        factors.len(),
                        head_dim / 2
                    )));
                }
                freqs
                    .iter()
                    .zip(factors)
                    .map(|(f, &d)| f / f64::from(d))
                    .collect()
            }
        };
        Ok((
            freqs.into_iter().map(|f| f as f32).collect(),
            attention_factor,
        ))
    }
}

/// YaRN's default attention factor as transformers computes it: `0.1 * mscale * ln(scale) + 1`,
/// 1 for `scale <= 1` (`get_mscale` in `_compute_yarn_parameters`).
pub fn yarn_mscale(scale: f64, mscale: f64) -> f64 {
    if scale <= 1.0 {
        1.0
    } else {
        0.1 * mscale * scale.ln() + 1.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_frequencies() {
        let rope = RopeConfig::new(10_000.0, RopeLayout::RotateHalf);
        let (f, a) = rope.inv_freq(8).expect("even");
        assert_eq!(a, 1.0);
        assert_eq!(f, vec![1.0, 0.1, 0.01, 0.001]);
        assert!(rope.inv_freq(7).is_err());
    }

    /// Llama 3.1's published rope_scaling on a 128-dim head: the highest frequencies are kept,
    /// the lowest divided by 8, the band between interpolated (values worked by hand from the
    /// formula: wavelength 2π/f against 8192/4 = 2048 and 8192/1 = 8192).
    #[test]
    fn llama3_bands() {
        let rope = RopeConfig {
            scaling: RopeScaling::Llama3 {
                factor: 8.0,
                low_freq_factor: 1.0,
                high_freq_factor: 4.0,
                original_max_position_embeddings: 8192.0,
            },
            ..RopeConfig::new(500_000.0, RopeLayout::RotateHalf)
        };
        let (f, _) = rope.inv_freq(128).expect("even");
        let base = |i: usize| 1.0 / 500_000f64.powf(2.0 * i as f64 / 128.0);
        // Pair 0: wavelength 2π < 2048, kept.
        assert_eq!(f[0], base(0) as f32);
        // Pair 63: wavelength 2π / 500000^(-126/128) ≈ 2.5e6 > 8192, divided by 8.
        assert_eq!(f[63], (base(63) / 8.0) as f32);
        // Pair 40: wavelength 2π·500000^(80/128) ≈ 2.3e4 > 8192: divided. Pair 34:
        // 2π·500000^(68/128) ≈ 6.0e3, inside the band: smooth = (8192/λ - 1) / 3.
        let lambda = 2.0 * std::f64::consts::PI / base(34);
        assert!(lambda > 2048.0 && lambda < 8192.0);
        let smooth = (8192.0 / lambda - 1.0) / 3.0;
        let expected = (1.0 - smooth) * base(34) / 8.0 + smooth * base(34);
        assert_eq!(f[34], expected as f32);
    }

    /// YaRN on a 16-dim head with theta 10000, factor 4, 32 original positions, betas 32 / 1:
    /// correction dims 16 ln(32 / (2π·32)) / (2 ln 10000) = -1.596… → floor -2 → 0 and
    /// 16 ln(32 / 2π) / (2 ln 10000) = 1.414… → ceil 2, so pair 0 keeps its frequency, pair 1 is
    /// half interpolated, pairs 2.. are divided by 4.
    #[test]
    fn yarn_ramp() {
        let rope = RopeConfig {
            scaling: RopeScaling::Yarn {
                factor: 4.0,
                original_max_position_embeddings: 32.0,
                beta_fast: 32.0,
                beta_slow: 1.0,
                attention_factor: yarn_mscale(4.0, 1.0),
                truncate: true,
            },
            ..RopeConfig::new(10_000.0, RopeLayout::RotateHalf)
        };
        let (f, a) = rope.inv_freq(16).expect("even");
        let base = |i: usize| 1.0 / 10_000f64.powf(2.0 * i as f64 / 16.0);
        assert_eq!(f[0], base(0) as f32);
        assert_eq!(f[1], (0.5 * base(1) / 4.0 + 0.5 * base(1)) as f32);
        for (i, &fi) in f.iter().enumerate().skip(2) {
            assert_eq!(fi, (base(i) / 4.0) as f32, "pair {i}");
        }
        assert!((a - (0.1 * 4f64.ln() + 1.0)).abs() < 1e-15);
    }
}
