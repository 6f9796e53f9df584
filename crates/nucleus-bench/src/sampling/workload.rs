//! The benchmark's data and parameter sets: seeded synthetic logits and the workloads (a)-(g).
//!
//! The logits imitate an LM head's output: every value is drawn from normal(0, 3), then five
//! spikes per row at distinct random positions get `row max + U(-2, 8)` (the row max of the
//! normal part), so a few tokens carry most of the mass, as after a trained model. Workload
//! (g) reads a second matrix, flat rows ([`Body::Flat`]: normal(0, 1), no spikes), where no
//! token holds much of the mass and top-p keeps most of the row. The random
//! numbers come from a small deterministic generator written here ([`SplitMix64`], Box–Muller
//! for the normals), not from `rand`: the data depend on the seed alone, never on a crate
//! version.

use nucleus_sampling::SamplingParams;

/// Spikes per row.
pub const SPIKES: usize = 5;

/// Previous token ids per row that the repetition penalty of workload (f) looks at.
pub const HISTORY: usize = 256;

/// The default seed of the generated data.
pub const DEFAULT_SEED: u64 = 0x5EED_0F10_6175;

/// SplitMix64 (Steele, Lea and Flood, "Fast splittable pseudorandom number generators",
/// OOPSLA 2014; the seeding generator of xoshiro): a 64-bit counter through a mixing function.
#[derive(Clone, Debug)]
pub struct SplitMix64 {
    state: u64,
    /// The second normal of the last Box–Muller pair, not yet returned.
    spare: Option<f64>,
}

impl SplitMix64 {
    /// A generator whose whole output is fixed by `seed`.
    pub fn new(seed: u64) -> Self {
        Self {
            state: seed,
            spare: None,
        }
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.state = self.state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.state;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// A uniform f64 in `[0, 1)` with 53 random bits.
    pub fn next_f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
    }

    /// A uniform f64 in `[lo, hi)`.
    pub fn uniform(&mut self, lo: f64, hi: f64) -> f64 {
        lo + (hi - lo) * self.next_f64()
    }

    /// A uniform integer in `0..n` (multiply-shift; the bias is below `n / 2^64`). `n > 0`.
    pub fn below(&mut self, n: u64) -> u64 {
        ((u128::from(self.next_u64()) * u128::from(n)) >> 64) as u64
    }

    /// A standard normal by Box–Muller: `sqrt(-2 ln u1) * (cos, sin)(2 pi u2)`, `u1` in `(0, 1]`.
    pub fn normal(&mut self) -> f64 {
        if let Some(z) = self.spare.take() {
            return z;
        }
        let u1 = 1.0 - self.next_f64();
        let u2 = self.next_f64();
        let r = (-2.0 * u1.ln()).sqrt();
        let (s, c) = (std::f64::consts::TAU * u2).sin_cos();
        self.spare = Some(r * s);
        r * c
    }
}

/// How the rows are drawn.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Body {
    /// normal(0, 3) and five spikes per row (workloads (a)-(f)).
    Spiked,
    /// normal(0, 1), no spikes (workload (g)).
    Flat,
}

/// A generated logits matrix `[batch, vocab]` (dense, f32) and what was planted in it.
#[derive(Clone, Debug, PartialEq)]
pub struct Logits {
    /// Row-major `[batch, vocab]` values.
    pub data: Vec<f32>,
    /// Rows.
    pub batch: usize,
    /// Values per row (token ids `0..vocab`).
    pub vocab: usize,
    /// Per row, the distinct positions of its five spikes, in the order they were drawn
    /// (empty for [`Body::Flat`]).
    pub spikes: Vec<[u32; SPIKES]>,
    /// Per row, the max of its normal(0, 3) part, before the spikes were planted.
    pub base_max: Vec<f32>,
    /// Per row, [`HISTORY`] previous token ids (uniform, repeats allowed) for the penalty.
    pub history: Vec<Vec<u32>>,
}

impl Logits {
    /// Generates `[batch, vocab]` logits from `seed`: normal(0, 3) everywhere, then five spikes
    /// per row at distinct uniform positions with value `base max + U(-2, 8)`; then each row's
    /// previous ids. Rows are drawn one after another from one stream, so row `i` is the same
    /// for every `batch > i`. Panics if `vocab < 5` or `vocab > u32::MAX`, or when the memory
    /// cannot be had ([`Logits::try_generate`] returns an error instead).
    pub fn generate(batch: usize, vocab: usize, seed: u64) -> Self {
        Self::try_generate(batch, vocab, seed).unwrap_or_else(|e| panic!("{e}"))
    }

    /// [`Logits::generate`], with every buffer reserved (fallibly) before it is filled.
    ///
    /// # Errors
    /// `vocab` outside `5..=u32::MAX`, `batch * vocab` overflowing, or memory that cannot be
    /// had.
    pub fn try_generate(batch: usize, vocab: usize, seed: u64) -> anyhow::Result<Self> {
        Self::try_generate_body(batch, vocab, seed, Body::Spiked)
    }

    /// [`Logits::try_generate`] for either body: [`Body::Flat`] rows are normal(0, 1) with no
    /// spikes (and the same previous ids).
    ///
    /// # Errors
    /// As [`Logits::try_generate`].
    pub fn try_generate_body(
        batch: usize,
        vocab: usize,
        seed: u64,
        body: Body,
    ) -> anyhow::Result<Self> {
        anyhow::ensure!(
            (SPIKES..=u32::MAX as usize).contains(&vocab),
            "vocab {vocab} outside 5..=u32::MAX"
        );
        let cells = batch
            .checked_mul(vocab)
            .ok_or_else(|| anyhow::anyhow!("{batch} x {vocab} logits overflow usize"))?;
        let mut rng = SplitMix64::new(seed);
        let mut data = crate::try_collect(cells, std::iter::empty(), "the logits")?;
        let mut spikes = crate::try_collect(batch, std::iter::empty(), "the spikes")?;
        let mut base_max = crate::try_collect(batch, std::iter::empty(), "the row maxima")?;
        let mut history = crate::try_collect(batch, std::iter::empty(), "the histories")?;
        for _ in 0..batch {
            let start = data.len();
            let sd = match body {
                Body::Spiked => 3.0,
                Body::Flat => 1.0,
            };
            data.extend((0..vocab).map(|_| (sd * rng.normal()) as f32));
            let row = &mut data[start..];
            let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            if body == Body::Flat {
                base_max.push(max);
                history.push(crate::try_collect(
                    HISTORY,
                    std::iter::repeat_with(|| rng.below(vocab as u64) as u32),
                    "a history",
                )?);
                continue;
            }
            let mut at = [0u32; SPIKES];
            let mut n = 0;
            while n < SPIKES {
                let pos = rng.below(vocab as u64) as u32;
                if !at[..n].contains(&pos) {
                    at[n] = pos;
                    n += 1;
                }
            }
            for &pos in &at {
                row[pos as usize] = (f64::from(max) + rng.uniform(-2.0, 8.0)) as f32;
            }
            spikes.push(at);
            base_max.push(max);
            history.push(crate::try_collect(
                HISTORY,
                std::iter::repeat_with(|| rng.below(vocab as u64) as u32),
                "a history",
            )?);
        }
        Ok(Self {
            data,
            batch,
            vocab,
            spikes,
            base_max,
            history,
        })
    }

    /// Row `i`.
    pub fn row(&self, i: usize) -> &[f32] {
        &self.data[i * self.vocab..(i + 1) * self.vocab]
    }
}

/// One parameter set of the benchmark, applied to every row.
#[derive(Clone, Debug)]
pub struct Workload {
    /// The letter: `'a'` .. `'g'`.
    pub id: char,
    /// What it does, e.g. `"top-k 50"`.
    pub name: &'static str,
    /// The parameters every path is given (the baselines read the same values).
    pub params: SamplingParams,
    /// Whether the rows' [`Logits::history`] is the context of the repetition penalty.
    pub uses_history: bool,
    /// The rows it reads: spiked (a)-(f) or flat (g).
    pub body: Body,
}

impl Workload {
    /// `"(a) top-k 50"`.
    pub fn label(&self) -> String {
        format!("({}) {}", self.id, self.name)
    }
}

/// The seed of every row's Philox stream in the benchmark.
pub const SAMPLE_SEED: u64 = 42;

/// The workloads of the measurement, in order: (a) top-k 50, (b) top-p 0.9, (c) temperature
/// 0.8 + top-k 50 + top-p 0.9, (d) min-p 0.05, (e) greedy, (f) repetition penalty 1.1 over
/// the row's 256 previous ids + (c), on the spiked rows; (g) top-p 0.9 on the flat rows. All
/// at temperature 1 unless said.
pub fn workloads() -> Vec<Workload> {
    let seed = Some(SAMPLE_SEED);
    let c = SamplingParams {
        temperature: 0.8,
        top_k: 50,
        top_p: 0.9,
        seed,
        ..Default::default()
    };
    vec![
        Workload {
            id: 'a',
            name: "top-k 50",
            params: SamplingParams {
                top_k: 50,
                seed,
                ..Default::default()
            },
            uses_history: false,
            body: Body::Spiked,
        },
        Workload {
            id: 'b',
            name: "top-p 0.9",
            params: SamplingParams {
                top_p: 0.9,
                seed,
                ..Default::default()
            },
            uses_history: false,
            body: Body::Spiked,
        },
        Workload {
            id: 'c',
            name: "T 0.8 + top-k 50 + top-p 0.9",
            params: c.clone(),
            uses_history: false,
            body: Body::Spiked,
        },
        Workload {
            id: 'd',
            name: "min-p 0.05",
            params: SamplingParams {
                min_p: 0.05,
                seed,
                ..Default::default()
            },
            uses_history: false,
            body: Body::Spiked,
        },
        Workload {
            id: 'e',
            name: "greedy",
            params: SamplingParams {
                seed,
                ..SamplingParams::greedy()
            },
            uses_history: false,
            body: Body::Spiked,
        },
        Workload {
            id: 'f',
            name: "rep. penalty 1.1 (256 ids) + (c)",
            params: SamplingParams {
                repetition_penalty: 1.1,
                ..c
            },
            uses_history: true,
            body: Body::Spiked,
        },
        Workload {
            id: 'g',
            name: "top-p 0.9, flat rows",
            params: SamplingParams {
                top_p: 0.9,
                seed,
                ..Default::default()
            },
            uses_history: false,
            body: Body::Flat,
        },
    ]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn generator_is_deterministic_and_rows_do_not_depend_on_the_batch() {
        let a = Logits::generate(3, 1000, 7);
        assert_eq!(a, Logits::generate(3, 1000, 7));
        assert_ne!(a.data, Logits::generate(3, 1000, 8).data);
        let one = Logits::generate(1, 1000, 7);
        assert_eq!(one.row(0), a.row(0));
        assert_eq!(one.spikes[0], a.spikes[0]);
        assert_eq!(one.history[0], a.history[0]);
        // A fixed value pins the generator itself (SplitMix64 of seed 0, first output).
        assert_eq!(SplitMix64::new(0).next_u64(), 0xE220_A839_7B1D_CDAF);
    }

    #[test]
    fn flat_rows_are_normal_0_1_without_spikes() {
        let logits = Logits::try_generate_body(4, 5000, DEFAULT_SEED, Body::Flat).unwrap();
        assert!(logits.spikes.is_empty());
        let n = logits.data.len() as f64;
        let mean = logits.data.iter().map(|&l| f64::from(l)).sum::<f64>() / n;
        let sd = (logits
            .data
            .iter()
            .map(|&l| f64::from(l).powi(2))
            .sum::<f64>()
            / n
            - mean * mean)
            .sqrt();
        assert!(mean.abs() < 0.05, "mean {mean}");
        assert!((sd - 1.0).abs() < 0.05, "standard deviation {sd}");
        // No token holds much: the largest probability is far below top-p's 0.9.
        let row = logits.row(0);
        let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let z: f64 = row.iter().map(|&l| f64::from(l - max).exp()).sum();
        assert!(1.0 / z < 0.01, "p_max {}", 1.0 / z);
        assert_eq!(logits.history[3].len(), HISTORY);
    }

    #[test]
    fn every_row_has_five_spikes_over_a_normal_0_3_body() {
        let vocab = 2000;
        let logits = Logits::generate(8, vocab, DEFAULT_SEED);
        let (mut n, mut sum, mut sum_sq) = (0usize, 0.0f64, 0.0f64);
        for i in 0..logits.batch {
            let row = logits.row(i);
            let spikes = logits.spikes[i];
            let max = logits.base_max[i];
            for (j, &pos) in spikes.iter().enumerate() {
                assert!((pos as usize) < vocab);
                assert!(!spikes[..j].contains(&pos), "row {i}: spike {pos} twice");
                let offset = row[pos as usize] - max;
                assert!(
                    (-2.0 - 1e-4..8.0 + 1e-4).contains(&offset),
                    "row {i}: spike at {pos} is max {offset:+}"
                );
            }
            for (id, &l) in row.iter().enumerate() {
                if !spikes.contains(&(id as u32)) {
                    assert!(l <= max);
                    n += 1;
                    sum += f64::from(l);
                    sum_sq += f64::from(l) * f64::from(l);
                }
            }
            assert_eq!(logits.history[i].len(), HISTORY);
            assert!(logits.history[i].iter().all(|&id| (id as usize) < vocab));
        }
        let mean = sum / n as f64;
        let sd = (sum_sq / n as f64 - mean * mean).sqrt();
        assert!(mean.abs() < 0.15, "mean {mean}");
        assert!((sd - 3.0).abs() < 0.15, "standard deviation {sd}");
    }

    #[test]
    fn workloads_are_valid_and_named_a_to_g() {
        let ids: String = workloads().iter().map(|w| w.id).collect();
        assert_eq!(ids, "abcdefg");
        for w in workloads() {
            w.params.validate().unwrap();
        }
    }
}
