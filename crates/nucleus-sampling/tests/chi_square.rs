//! Statistical tests: token frequencies over many independent draws against `distribution()`,
//! by Pearson's chi-square test.
//!
//! Each draw varies `position` (or `sample_index`) with a fixed seed: the spec's Philox stream
//! gives an independent uniform per (seed, position, sample_index). Each test rejects at upper
//! tail probability ALPHA = 1e-6, with the critical value computed by Wilson–Hilferty in
//! `common/stats.rs` (conservative there: the exact tail at that value is between 1.6e-7 for
//! df = 1 and 9.4e-7 for df = 110). With the 8 chi-square tests of this file, a correct sampler
//! fails this file with probability below 8e-6. The seeds are fixed, so a given implementation
//! either passes or fails deterministically; the bound is over the choice of seeds.
//!
//! `distribution()` itself is checked against the f64 oracle first, so frequencies are tied to
//! the spec, not only to the implementation's own claim.

mod common;

use common::oracle::oracle;
use common::stats::{chi_square_test, normal_upper_quantile};
use common::{assert_close, inverse_cdf, normal_row, spec_uniform, SplitMix};
use nucleus_sampling::{distribution, sample_row, SampleRequest, SamplingParams};
use rayon::prelude::*;

const ALPHA: f64 = 1e-6;

enum Vary {
    Position,
    SampleIndex { position: u64 },
}

/// Draws `n` tokens, checks each against the spec's inverse CDF when the oracle is clear of
/// boundaries, and runs the chi-square test against `distribution()`.
fn run(row: &[f32], params: &SamplingParams, prompt: &[u32], n: u32, vary: Vary, what: &str) {
    run_with_output(row, params, prompt, &[], n, vary, what);
}

/// As [`run`], with generated ids (for the frequency and presence penalties).
fn run_with_output(
    row: &[f32],
    params: &SamplingParams,
    prompt: &[u32],
    output: &[u32],
    n: u32,
    vary: Vary,
    what: &str,
) {
    let base = SampleRequest::new(params, prompt, output, 0);
    let d = distribution(row, &base).expect("distribution");
    let o = oracle(row, params, prompt, output).expect("oracle");
    assert!(
        !o.fragile,
        "{what}: test row sits on a rounding boundary; pick another"
    );
    assert_close(&d, &o.probs, 1e-6, what);
    let seed = params.seed.expect("seeded");

    let tokens: Vec<u32> = (0..n)
        .into_par_iter()
        .map(|i| {
            let mut req = base;
            let (position, index) = match vary {
                Vary::Position => (u64::from(i), 0),
                Vary::SampleIndex { position } => (position, i),
            };
            req.position = position;
            req.sample_index = index;
            let out = sample_row(row, &req).expect("sample_row");
            if let Some(want) = inverse_cdf(&o.probs, spec_uniform(seed, position, index), 1e-5) {
                assert_eq!(
                    out.token, want,
                    "{what}: position {position}, sample {index}"
                );
            }
            out.token
        })
        .collect();

    let mut counts = vec![0u64; row.len()];
    for &t in &tokens {
        counts[t as usize] += 1;
    }
    let distinct = counts.iter().filter(|&&c| c > 0).count();
    let support = d.iter().filter(|&&p| p > 0.0).count();
    assert!(
        distinct > 1 || support == 1,
        "{what}: all {n} draws gave one token"
    );
    let chi = chi_square_test(&counts, &d, ALPHA);
    assert_eq!(chi.outside_support, 0, "{what}: draws outside the support");
    assert!(
        chi.statistic < chi.critical,
        "{what}: chi-square {:.1} >= critical {:.1} (df {}, alpha {ALPHA})",
        chi.statistic,
        chi.critical,
        chi.df
    );
}

#[test]
fn critical_value_is_sane() {
    // z for 1e-6 is 4.7534 (Φ^-1(1 - 1e-6)); the Wilson–Hilferty value for df = 10 is 47.96.
    let z = normal_upper_quantile(1e-6);
    assert!((z - 4.753_424).abs() < 1e-3, "z = {z}");
    let c = common::stats::chi_square_critical(10, 1e-6);
    assert!((c - 47.96).abs() < 0.05, "crit(10) = {c}");
}

fn vocab_111(seed: u64) -> Vec<f32> {
    normal_row(seed, 111, 1.5)
}

#[test]
fn vocab_111_plain_softmax() {
    let p = SamplingParams {
        seed: Some(1),
        ..Default::default()
    };
    run(&vocab_111(1), &p, &[], 60_000, Vary::Position, "111, T 1");
}

#[test]
fn vocab_111_temperature_07_top_k_20() {
    let p = SamplingParams {
        temperature: 0.7,
        top_k: 20,
        seed: Some(2),
        ..Default::default()
    };
    run(
        &vocab_111(2),
        &p,
        &[],
        60_000,
        Vary::Position,
        "111, T 0.7, top_k 20",
    );
}

#[test]
fn vocab_111_temperature_13_top_p_08() {
    let p = SamplingParams {
        temperature: 1.3,
        top_p: 0.8,
        seed: Some(3),
        ..Default::default()
    };
    run(
        &vocab_111(3),
        &p,
        &[],
        60_000,
        Vary::Position,
        "111, T 1.3, top_p 0.8",
    );
}

#[test]
fn vocab_111_all_filters_and_repetition_penalty() {
    let p = SamplingParams {
        temperature: 0.5,
        top_k: 40,
        top_p: 0.95,
        repetition_penalty: 1.3,
        seed: Some(4),
        ..Default::default()
    };
    let prompt: Vec<u32> = (0..30).map(|i| i * 3).collect();
    run(
        &vocab_111(4),
        &p,
        &prompt,
        60_000,
        Vary::Position,
        "111, T 0.5, k 40, p 0.95, r 1.3",
    );
}

#[test]
fn vocab_111_min_p_penalties_and_logit_bias() {
    // min_p 0.05 at T 0.9 cuts the tail; frequency/presence act on the output ids only, the
    // repetition penalty on prompt + output; the biases include clamped ones (+-100).
    let p = SamplingParams {
        temperature: 0.9,
        min_p: 0.05,
        repetition_penalty: 1.2,
        presence_penalty: 0.7,
        frequency_penalty: 0.3,
        logit_bias: [(1u32, 2.0), (7, -1.5), (20, -250.0), (33, 0.8), (50, 1e6)]
            .into_iter()
            .collect(),
        seed: Some(6),
        ..Default::default()
    };
    let prompt: Vec<u32> = (0..20).map(|i| i * 5).collect();
    let output: Vec<u32> = vec![3, 8, 3, 3, 60, 8, 90, 51];
    let base = vocab_111(6);
    let top = base.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let row: Vec<f32> = base
        .iter()
        .enumerate()
        // Token 50's logit sits 100 below the row's maximum, so its clamped +100 bias makes
        // it one candidate among others (unclamped it would take all the mass).
        .map(|(i, &l)| if i == 50 { top - 100.0 } else { l })
        .collect();
    run_with_output(
        &row,
        &p,
        &prompt,
        &output,
        60_000,
        Vary::Position,
        "111, T 0.9, min_p 0.05, r 1.2, presence 0.7, frequency 0.3, bias",
    );
    // The parameters bite: min_p removes part of the row, token 50 (clamped bias) and token 20
    // (clamped to -100) end on either side of it.
    let o = oracle(&row, &p, &prompt, &output).expect("oracle");
    let support = o.support.iter().filter(|&&s| s).count();
    assert!((2..100).contains(&support), "support {support}");
    assert!(o.support[50] && !o.support[20]);
}

#[test]
fn vocab_111_ties_cut_by_top_k_and_top_p() {
    // Values from {0, 1, 2}: top_k 30 and top_p 0.6 cut inside tie groups, by id.
    let mut g = SplitMix(5);
    let row: Vec<f32> = (0..111).map(|_| g.below(3) as f32).collect();
    let p = SamplingParams {
        top_k: 30,
        seed: Some(5),
        ..Default::default()
    };
    run(&row, &p, &[], 40_000, Vary::Position, "111 ties, top_k 30");
    let p = SamplingParams {
        temperature: 2.0,
        top_p: 0.6,
        seed: Some(6),
        ..Default::default()
    };
    run(
        &row,
        &p,
        &[],
        40_000,
        Vary::Position,
        "111 ties, T 2, top_p 0.6",
    );
}

#[test]
fn vocab_32000_temperature_08_top_k_50_top_p_09() {
    let row = normal_row(32_000, 32_000, 2.0);
    let p = SamplingParams {
        temperature: 0.8,
        top_k: 50,
        top_p: 0.9,
        repetition_penalty: 1.0,
        seed: Some(32_000),
        ..Default::default()
    };
    run(
        &row,
        &p,
        &[],
        40_000,
        Vary::Position,
        "32000, T 0.8, k 50, p 0.9",
    );
}

#[test]
fn sample_index_draws_are_distinct_and_distributed_alike() {
    let row = vocab_111(7);
    let p = SamplingParams {
        temperature: 1.0,
        top_k: 30,
        seed: Some(7),
        ..Default::default()
    };
    // Same position, samples 0..n: each is the spec's draw for its index (checked in `run`),
    // and together they follow the distribution.
    run(
        &row,
        &p,
        &[],
        60_000,
        Vary::SampleIndex { position: 1234 },
        "111, sample_index",
    );
    // The n samples of one position are not one token repeated.
    let tokens: Vec<u32> = (0..32)
        .map(|i| {
            let mut req = SampleRequest::new(&p, &[], &[], 1234);
            req.sample_index = i;
            sample_row(&row, &req).unwrap().token
        })
        .collect();
    let distinct: std::collections::BTreeSet<_> = tokens.iter().collect();
    assert!(distinct.len() > 4, "32 samples gave {tokens:?}");
}
