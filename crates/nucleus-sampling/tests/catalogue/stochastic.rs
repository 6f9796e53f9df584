//! The stochastic catalogue (`chain/stochastic.rs`): XTC, mirostat v1 / v2 and adaptive-p, from
//! llama.cpp's `src/llama-sampler.cpp`.
//!
//! For each: hand-worked tables (the arithmetic in the comments), a slow f64 oracle written
//! here from the anchor's algorithm and compared on random rows, chi-square tests with fixed
//! seeds against the exact distribution (alpha 1e-6 per test: a correct implementation fails
//! one such test once in a million runs), parameter errors naming the field, reset / accept /
//! clone, and the JSON configuration. Expected values never come from running the code under
//! test; the coin and the draws are recomputed with the reference Philox of `common`.

use crate::common;

use common::stats::chi_square_test;
use common::{
    assert_close, inverse_cdf, ln_row, reference_philox4x32_10, spec_uniform, uniform_from_words,
    SplitMix,
};
use nucleus_sampling::chain::{
    mirostat_distribution, mirostat_update, AdaptiveP, AdaptivePState, ChainError, LogitsProcessor,
    Mirostat, MirostatVersion, ProcessorConfig, ProcessorContext, SamplerChain, Selection,
    Temperature, Xtc,
};
use nucleus_sampling::{philox, LogprobsKind, SampleError};

const NEG: f32 = f32::NEG_INFINITY;
const ALPHA: f64 = 1e-6;

fn ctx_at(position: u64) -> ProcessorContext<'static> {
    ProcessorContext::new(&[], &[], position)
}

/// XTC's coin from the reference Philox: counter (position, sample_index, kind 1).
fn xtc_coin(seed: u64, position: u64, sample_index: u32) -> f64 {
    uniform_from_words(reference_philox4x32_10(
        [position as u32, (position >> 32) as u32, sample_index, 1],
        [seed as u32, (seed >> 32) as u32],
    ))
}

fn xtc(threshold: f64, probability: f64, min_keep: usize) -> Xtc {
    Xtc::new(threshold, probability, min_keep).unwrap()
}

/// Applies XTC (probability 1: the coin always says apply, u < 1) to a copy of `row`.
fn xtc_applied(threshold: f64, min_keep: usize, row: &[f32]) -> Vec<f32> {
    let mut out = row.to_vec();
    xtc(threshold, 1.0, min_keep)
        .apply(&mut out, &ctx_at(0))
        .unwrap();
    out
}

fn removed(before: &[f32], after: &[f32]) -> Vec<usize> {
    (0..before.len())
        .filter(|&i| before[i] != NEG && after[i] == NEG)
        .collect()
}

// ---------------------------------------------------------------------------------------------
// f64 oracles, written from llama.cpp's algorithms
// ---------------------------------------------------------------------------------------------

/// Softmax in f64 over the finite logits (0 for -inf).
fn softmax64(row: &[f32]) -> Vec<f64> {
    let max = row.iter().copied().fold(NEG, f32::max) as f64;
    let e: Vec<f64> = row
        .iter()
        .map(|&l| {
            if l == NEG {
                0.0
            } else {
                (l as f64 - max).exp()
            }
        })
        .collect();
    let z: f64 = e.iter().sum();
    e.iter().map(|x| x / z).collect()
}

/// The finite ids by logit descending, ties to the lower id (a stable sort of the ids).
fn order(row: &[f32]) -> Vec<usize> {
    let mut ids: Vec<usize> = (0..row.len()).filter(|&i| row[i] != NEG).collect();
    ids.sort_by(|&a, &b| row[b].partial_cmp(&row[a]).unwrap());
    ids
}

fn renormalised(p: &[f64], keep: &[usize]) -> Vec<f64> {
    let z: f64 = keep.iter().map(|&i| p[i]).sum();
    let mut out = vec![0.0; p.len()];
    for &i in keep {
        out[i] = p[i] / z;
    }
    out
}

/// XTC with the coin saying apply: the removed ids, and whether a probability lies within
/// 1e-6 relative of the threshold (a boundary either answer may take).
fn xtc_oracle(row: &[f32], threshold: f64, min_keep: usize) -> (Vec<usize>, bool) {
    let p = softmax64(row);
    let ord = order(row);
    if ord.len() < 2 || threshold > 0.5 {
        return (vec![], false);
    }
    let fragile = ord
        .iter()
        .any(|&i| (p[i] - threshold).abs() <= 1e-6 * threshold.max(1e-300));
    let reached = ord.iter().take_while(|&&i| p[i] >= threshold).count();
    let pos_last = reached.saturating_sub(1);
    if pos_last > 0 && ord.len() - pos_last >= min_keep {
        let mut r = ord[..pos_last].to_vec();
        r.sort();
        (r, fragile)
    } else {
        (vec![], fragile)
    }
}

/// Mirostat v1's k (real, before truncation) and truncated distribution for `mu`.
fn mirostat_v1_oracle(row: &[f32], m: usize, mu: f64) -> (f64, Vec<f64>) {
    let p = softmax64(row);
    let ord = order(row);
    let pairs = (m - 1).min(ord.len() - 1);
    let (mut num, mut den) = (0.0, 0.0);
    for i in 0..pairs {
        let t = ((i + 2) as f64 / (i + 1) as f64).ln();
        let b = (p[ord[i]] / p[ord[i + 1]]).ln();
        num += t * b;
        den += t * t;
    }
    let s_hat = num / den;
    let eps = s_hat - 1.0;
    let n_vocab = row.len() as f64;
    let k_real = ((eps * 2f64.powf(mu)) / (1.0 - n_vocab.powf(-eps))).powf(1.0 / s_hat);
    let k = if k_real.is_nan() {
        1
    } else {
        (k_real.floor().min(1e18) as usize).max(1)
    };
    let keep: Vec<usize> = ord.iter().copied().take(k).collect();
    (k_real, renormalised(&p, &keep))
}

/// Mirostat v2's truncated distribution for `mu`, and whether a surprise lies within 1e-6 of
/// `mu`.
fn mirostat_v2_oracle(row: &[f32], mu: f64) -> (Vec<f64>, bool) {
    let p = softmax64(row);
    let ord = order(row);
    let fragile = ord.iter().any(|&i| (-p[i].log2() - mu).abs() <= 1e-6);
    let mut keep: Vec<usize> = ord
        .iter()
        .copied()
        .take_while(|&i| -p[i].log2() <= mu)
        .collect();
    if keep.is_empty() {
        keep.push(ord[0]);
    }
    (renormalised(&p, &keep), fragile)
}

/// Adaptive-p's transformed distribution for the state (weighted_sum, total_weight).
fn adaptive_oracle(row: &[f32], target: f64, ws: f64, tw: f64) -> Vec<f64> {
    let p = softmax64(row);
    if target < 0.0 {
        return p;
    }
    let t = target.clamp(0.0, 1.0);
    let a = if tw == 0.0 { t } else { 2.0 * t - ws / tw }.clamp(0.0, 1.0);
    // The transformed logits of the candidates, in f64.
    let new: Vec<f64> = (0..row.len())
        .map(|i| {
            let d = ((p[i] - a) / 0.3).abs();
            5.0 - 10.0 * d * d / (1.0 + d)
        })
        .collect();
    let cand: Vec<usize> = (0..row.len()).filter(|&i| row[i] != NEG).collect();
    let max = cand
        .iter()
        .map(|&i| new[i])
        .fold(f64::NEG_INFINITY, f64::max);
    let mut e = vec![0.0; row.len()];
    for &i in &cand {
        e[i] = (new[i] - max).exp();
    }
    let z: f64 = e.iter().sum();
    e.iter().map(|x| x / z).collect()
}

/// A random row: `n` logits, roughly normal times `scale`, some quantised (ties) and some -inf
/// (never all).
fn random_row(g: &mut SplitMix, n: usize, scale: f64) -> Vec<f32> {
    let quantise = g.below(2) == 0;
    let mut row: Vec<f32> = (0..n)
        .map(|_| {
            let v = g.normal() * scale;
            if quantise {
                ((v * 2.0).round() / 2.0) as f32
            } else {
                v as f32
            }
        })
        .collect();
    if n > 2 {
        for _ in 0..g.below(n as u64 / 3 + 1) {
            let i = g.below(n as u64) as usize;
            row[i] = NEG;
        }
    }
    if row.iter().all(|&l| l == NEG) {
        row[0] = 0.0;
    }
    row
}

fn chain(selection: Selection) -> SamplerChain {
    SamplerChain::new(selection)
}

fn param_field(e: SampleError) -> &'static str {
    match e {
        SampleError::InvalidParams(p) => p.field,
        other => panic!("expected InvalidParams, got {other:?}"),
    }
}

// ---------------------------------------------------------------------------------------------
// XTC
// ---------------------------------------------------------------------------------------------

#[test]
fn xtc_removes_all_but_the_least_likely_of_the_tokens_above_threshold() {
    // One above: probs [0.7, 0.09, 0.08, 0.07, 0.06], threshold 0.1: only 0.7 reaches it,
    // pos_last = 0 -> unchanged.
    let row = ln_row(&[0.7, 0.09, 0.08, 0.07, 0.06]);
    assert_eq!(xtc_applied(0.1, 1, &row), row, "one above");

    // Two above: probs [0.12, 0.35, 0.08, 0.45], threshold 0.2: 0.45 (id 3) and 0.35 (id 1)
    // reach it; order 3, 1 -> pos_last = 1, 4 - 1 = 3 >= 1: id 3 goes, id 1 stays.
    let row = ln_row(&[0.12, 0.35, 0.08, 0.45]);
    let out = xtc_applied(0.2, 1, &row);
    assert_eq!(removed(&row, &out), vec![3], "two above");
    assert_eq!(out[1], row[1]);

    // Three above: probs [0.5, 0.3, 0.15, 0.05], threshold 0.1: 0.5, 0.3, 0.15 reach it,
    // pos_last = 2, 4 - 2 = 2 >= 1: ids 0 and 1 go, 0.15 (id 2) and 0.05 stay.
    let row = ln_row(&[0.5, 0.3, 0.15, 0.05]);
    let out = xtc_applied(0.1, 1, &row);
    assert_eq!(removed(&row, &out), vec![0, 1], "three above");
    assert_eq!(&out[2..], &row[2..]);
}

#[test]
fn xtc_min_keep_blocks_when_too_few_would_remain() {
    // probs [0.3, 0.25, 0.2, 0.15, 0.1], threshold 0.12: four reach it (0.1 does not),
    // pos_last = 3, candidates left 5 - 3 = 2.
    let row = ln_row(&[0.3, 0.25, 0.2, 0.15, 0.1]);
    // min_keep 2: 2 >= 2 applies (ids 0, 1, 2 go); min_keep 3: 2 < 3 blocks.
    assert_eq!(removed(&row, &xtc_applied(0.12, 2, &row)), vec![0, 1, 2]);
    assert_eq!(xtc_applied(0.12, 3, &row), row, "min_keep 3 blocks");
    // min_keep 0 never blocks.
    assert_eq!(removed(&row, &xtc_applied(0.12, 0, &row)), vec![0, 1, 2]);

    // -inf tokens are not candidates: [0, 0, -inf, -inf] is p = [0.5, 0.5]; threshold 0.4:
    // both reach it, pos_last = 1, candidates left 2 - 1 = 1: min_keep 2 blocks (counting the
    // -inf ids would give 3 and apply), min_keep 1 removes id 0 (the tie goes to the lower id,
    // which comes first in the order).
    let row = [0.0f32, 0.0, NEG, NEG];
    assert_eq!(xtc_applied(0.4, 2, &row), row);
    assert_eq!(xtc_applied(0.4, 1, &row), [NEG, 0.0, NEG, NEG]);
}

#[test]
fn xtc_threshold_edges_ties_and_small_rows() {
    // [0, 0]: p = 0.5 each, exactly. threshold 0.5 is on (`> 0.5` is off in llama.cpp): both
    // reach it, id 0 (first in the order) goes. Just above 0.5: off.
    let row = [0.0f32, 0.0];
    assert_eq!(xtc_applied(0.5, 1, &row), [NEG, 0.0]);
    assert_eq!(xtc_applied(0.500_001, 1, &row), row);
    // Ties: [1, 1, 1, -5] with threshold 0.2: p ~ 0.333 for ids 0-2, all reach it; order
    // 0, 1, 2; pos_last = 2: ids 0 and 1 go, id 2 (last of the tie) stays.
    let row = [1.0f32, 1.0, 1.0, -5.0];
    assert_eq!(removed(&row, &xtc_applied(0.2, 1, &row)), vec![0, 1]);
    // Threshold 0: every candidate reaches it; all but the least likely go.
    let row = [2.0f32, 1.0, 0.0, NEG];
    assert_eq!(xtc_applied(0.0, 1, &row), [NEG, NEG, 0.0, NEG]);
    // Fewer than two candidates: unchanged.
    let row = [5.0f32, NEG];
    assert_eq!(xtc_applied(0.0, 0, &row), row);
    // Probability 0 is off.
    let mut out = [0.0f32, 0.0];
    xtc(0.5, 0.0, 1).apply(&mut out, &ctx_at(0)).unwrap();
    assert_eq!(out, [0.0, 0.0]);
}

#[test]
fn xtc_coin_on_both_sides_of_probability() {
    // probability 0.3 on [0, 0] with threshold 0.5: applying removes id 0. Positions whose
    // XTC uniform (counter word 3 = 1) is below 0.3 apply, above do not; the selection's
    // uniform (word 3 = 0) at the same counter must not matter, so pick positions where the
    // two disagree.
    let seed = 0xC0FFEE;
    let p = 0.3;
    let mut found = [false; 2];
    for pos in 0..10_000u64 {
        let u = philox::uniform_kind(seed, pos, 0, philox::draw::XTC);
        assert_eq!(
            u,
            xtc_coin(seed, pos, 0),
            "uniform_kind is the reference Philox"
        );
        let select = spec_uniform(seed, pos, 0);
        let applies = u <= p;
        if (select <= p) == applies || found[applies as usize] {
            continue;
        }
        found[applies as usize] = true;
        let mut row = [0.0f32, 0.0];
        let mut ctx = ctx_at(pos);
        ctx.seed = seed;
        xtc(0.5, p, 1).apply(&mut row, &ctx).unwrap();
        let want = if applies { [NEG, 0.0] } else { [0.0, 0.0] };
        assert_eq!(row, want, "position {pos}, xtc uniform {u}");
    }
    assert_eq!(found, [true, true]);

    // The coin reads ctx.sample_index (counter word 2).
    let pos = (0..10_000u64)
        .find(|&pos| (xtc_coin(seed, pos, 0) <= p) != (xtc_coin(seed, pos, 5) <= p))
        .unwrap();
    for idx in [0u32, 5] {
        let mut row = [0.0f32, 0.0];
        let mut ctx = ctx_at(pos);
        ctx.seed = seed;
        ctx.sample_index = idx;
        xtc(0.5, p, 1).apply(&mut row, &ctx).unwrap();
        assert_eq!(
            row[0] == NEG,
            xtc_coin(seed, pos, idx) <= p,
            "sample index {idx}"
        );
    }
}

#[test]
fn xtc_in_a_chain_draws_its_coin_from_the_selection_seed() {
    // Mirostat v2 with a large mu (tau 20: mu 40 keeps everything) as the selection, so the
    // distribution is XTC's result renormalised: [0, 0] -> [0, 1] when the coin applies.
    let seed = 99u64;
    for pos in 0..64u64 {
        let mut c = chain(Selection::mirostat_v2(20.0, 0.1, Some(seed))).with(xtc(0.5, 0.5, 1));
        let d = c.distribution(&[0.0, 0.0], &ctx_at(pos)).unwrap();
        let want = if xtc_coin(seed, pos, 0) <= 0.5 {
            [0.0, 1.0]
        } else {
            [0.5, 0.5]
        };
        assert_close(&d, &want, 1e-12, &format!("position {pos}"));
    }
}

#[test]
fn xtc_matches_the_f64_oracle_on_random_rows() {
    let mut g = SplitMix(0x570C);
    let mut checked = 0;
    for &n in &[2usize, 3, 8, 37, 111, 1000, 32_000] {
        for r in 0..40 {
            let scale = [1.0, 2.5, 5.0][r % 3];
            let row = random_row(&mut g, n, scale);
            let threshold = [0.0, 0.01, 0.05, 0.1, 0.2, 0.3, 0.5][g.below(7) as usize];
            let min_keep = g.below(4) as usize;
            let (want, fragile) = xtc_oracle(&row, threshold, min_keep);
            if fragile {
                continue;
            }
            let out = xtc_applied(threshold, min_keep, &row);
            assert_eq!(
                removed(&row, &out),
                want,
                "n {n} row {r} threshold {threshold}"
            );
            for i in 0..n {
                if !want.contains(&i) {
                    assert_eq!(out[i].to_bits(), row[i].to_bits(), "kept values unchanged");
                }
            }
            checked += 1;
        }
    }
    assert!(checked > 200, "only {checked} rows checked");
}

#[test]
fn xtc_inside_a_sampled_chain_chi_square_per_coin_outcome() {
    // Temperature 0.8 then XTC (threshold 0.1, probability 0.5) then sampling with seed 7: at
    // positions whose coin applies the draws follow the oracle's XTC distribution, elsewhere
    // the plain softmax. alpha 1e-6 for each of the two tests.
    let row: Vec<f32> = vec![
        2.0, 1.6, 1.1, 0.9, 0.2, -0.3, -1.0, 0.5, NEG, -2.0, 1.3, 0.0,
    ];
    let t = 0.8f32;
    let scaled: Vec<f32> = row.iter().map(|&l| l / t).collect();
    let plain = softmax64(&scaled);
    let (gone, fragile) = xtc_oracle(&scaled, 0.1, 1);
    assert!(
        !fragile && gone.len() >= 2,
        "the row exercises XTC: {gone:?}"
    );
    let keep: Vec<usize> = (0..row.len())
        .filter(|&i| row[i] != NEG && !gone.contains(&i))
        .collect();
    let applied = renormalised(&plain, &keep);
    let seed = 7u64;
    let mut c = chain(Selection::sample(Some(seed)))
        .with(Temperature::new(f64::from(t)).unwrap())
        .with(xtc(0.1, 0.5, 1));
    let n = 20_000;
    let mut counts = [vec![0u64; row.len()], vec![0u64; row.len()]];
    let mut seen = [0usize; 2];
    let mut pos = 0u64;
    while seen[0] < n || seen[1] < n {
        let which = (xtc_coin(seed, pos, 0) <= 0.5) as usize;
        if seen[which] < n {
            let out = c.sample(&row, &ctx_at(pos), 0).unwrap();
            counts[which][out.token as usize] += 1;
            seen[which] += 1;
        }
        pos += 1;
    }
    for (which, probs) in [(0, &plain), (1, &applied)] {
        let cs = chi_square_test(&counts[which], probs, ALPHA);
        assert_eq!(
            cs.outside_support, 0,
            "coin {which}: draws outside the support"
        );
        assert!(cs.statistic < cs.critical, "coin {which}: {cs:?}");
    }
}

#[test]
fn xtc_parameter_errors_name_the_field() {
    for (t, p, field) in [
        (-0.1, 0.5, "xtc_threshold"),
        (1.5, 0.5, "xtc_threshold"),
        (f64::NAN, 0.5, "xtc_threshold"),
        (0.1, -0.1, "xtc_probability"),
        (0.1, 1.01, "xtc_probability"),
        (0.1, f64::NAN, "xtc_probability"),
    ] {
        assert_eq!(Xtc::new(t, p, 1).unwrap_err().field, field, "{t} {p}");
    }
    // Above 0.5 is accepted and off.
    assert!(!Xtc::new(0.6, 1.0, 1).unwrap().is_active());
    assert!(Xtc::new(0.5, 1.0, 1).unwrap().is_active());
}

// ---------------------------------------------------------------------------------------------
// Mirostat
// ---------------------------------------------------------------------------------------------

/// Zipf row with exponent 2 over 10 ids: l_i = -2 ln(i + 1), so b_i = ln(p_i / p_{i+1}) =
/// 2 t_i exactly and s_hat = 2.
fn zipf2() -> Vec<f32> {
    (0..10)
        .map(|i| (-2.0 * ((i + 1) as f64).ln()) as f32)
        .collect()
}

fn support(d: &[f64]) -> Vec<usize> {
    (0..d.len()).filter(|&i| d[i] > 0.0).collect()
}

#[test]
fn mirostat_v1_k_from_the_zipf_estimate() {
    // s_hat = 2, eps = 1, n_vocab = 10: k = (2^mu / (1 - 10^-1))^(1/2) = sqrt(2^mu / 0.9).
    // tau 1.9, mu 3.8: 2^3.8 = 13.929, / 0.9 = 15.476, sqrt 3.934 -> k = 3: p proportional to
    // 1, 1/4, 1/9 = [36, 9, 4] / 49.
    let row = zipf2();
    let d = chain(Selection::mirostat(1.9, 0.1, 100, Some(1)))
        .distribution(&row, &ctx_at(0))
        .unwrap();
    let mut want = vec![0.0; 10];
    want[..3].copy_from_slice(&[36.0 / 49.0, 9.0 / 49.0, 4.0 / 49.0]);
    assert_close(&d, &want, 1e-6, "mu 3.8");
    // tau 1.95, mu 3.9: 2^3.9 = 14.929, / 0.9 = 16.587, sqrt 4.073 -> k = 4:
    // [144, 36, 16, 9] / 205.
    let d = chain(Selection::mirostat(1.95, 0.1, 100, Some(1)))
        .distribution(&row, &ctx_at(0))
        .unwrap();
    let mut want = vec![0.0; 10];
    want[..4].copy_from_slice(&[144.0 / 205.0, 36.0 / 205.0, 16.0 / 205.0, 9.0 / 205.0]);
    assert_close(&d, &want, 1e-6, "mu 3.9");
    // The ids permuted: the k best by logit, wherever they are.
    let perm = [7usize, 2, 9, 0, 4, 1, 8, 3, 6, 5];
    let mut shuffled = vec![0.0f32; 10];
    for (rank, &id) in perm.iter().enumerate() {
        shuffled[id] = row[rank];
    }
    let d = chain(Selection::mirostat(1.9, 0.1, 100, Some(1)))
        .distribution(&shuffled, &ctx_at(0))
        .unwrap();
    assert_eq!(support(&d), vec![2, 7, 9]);
}

#[test]
fn mirostat_v1_m_limits_the_estimate() {
    // l_0 = 0, l_1 = -2 ln 2 (first pair exponent 2), then exponent 0.5: l_{i+1} = l_i -
    // 0.5 t_i with t_i = ln((i+2)/(i+1)).
    // m = 2: one pair, s_hat = 2, mu 3.8 -> k = 3 (as above).
    // m = 100: all 9 pairs: sum t_i^2 = 0.877217, of which t_0^2 = 0.480453, so
    // s_hat = (2 * 0.480453 + 0.5 * 0.396764) / 0.877217 = 1.321551, eps = 0.321551,
    // 10^-eps = 0.476919, k = (0.321551 * 13.9288 / 0.523081)^(1 / 1.321551)
    // = 8.56243^0.756686 = 5.078 -> k = 5.
    let mut row = vec![0.0f64, -2.0 * 2f64.ln()];
    for i in 1..9 {
        let t = ((i + 2) as f64 / (i + 1) as f64).ln();
        row.push(row[i] - 0.5 * t);
    }
    let row: Vec<f32> = row.iter().map(|&l| l as f32).collect();
    for (m, k) in [(2usize, 3usize), (100, 5)] {
        let (k_real, want) = mirostat_v1_oracle(&row, m, 3.8);
        assert_eq!(
            k_real as usize, k,
            "the oracle agrees with the hand value for m {m}"
        );
        let d = chain(Selection::mirostat(1.9, 0.1, m, Some(1)))
            .distribution(&row, &ctx_at(0))
            .unwrap();
        assert_eq!(support(&d), (0..k).collect::<Vec<_>>(), "m {m}");
        assert_close(&d, &want, 1e-6, &format!("m {m}"));
    }
}

#[test]
fn mirostat_v1_edges_single_candidate_and_ties() {
    // One candidate: s_hat = 0/0, k NaN -> 1: the token is certain. Accepting it (p = 1,
    // surprise 0) with tau 2, eta 0.5: mu = 4 - 0.5 (0 - 2) = 5.
    let mut c = chain(Selection::mirostat(2.0, 0.5, 100, Some(3)));
    let out = c.sample(&[NEG, 3.0, NEG], &ctx_at(0), 0).unwrap();
    assert_eq!((out.token, out.num_candidates), (1, 1));
    assert_eq!(c.mirostat_mu(), Some(4.0));
    c.accept(1);
    assert_eq!(c.mirostat_mu(), Some(5.0));
    // Equal logits: every b_i = 0, s_hat = 0, eps = -1, k = (2^mu / (n - 1))^(1/0) = inf when
    // 2^mu > n - 1 (all kept), 0 when below (k = 1, the lowest id).
    let row = [0.0f32; 8];
    let d = chain(Selection::mirostat(2.0, 0.1, 100, Some(1))) // 2^4 = 16 > 7
        .distribution(&row, &ctx_at(0))
        .unwrap();
    assert_close(&d, &[0.125; 8], 1e-12, "all kept");
    let d = chain(Selection::mirostat(1.0, 0.1, 100, Some(1))) // 2^2 = 4 < 7
        .distribution(&row, &ctx_at(0))
        .unwrap();
    assert_close(&d, &[1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0], 0.0, "k = 1");
    // A huge mu saturates k: every candidate kept (llama.cpp's int(inf) is undefined).
    let d = chain(Selection::mirostat(600.0, 0.1, 100, Some(1)))
        .distribution(&zipf2(), &ctx_at(0))
        .unwrap();
    assert_close(&d, &softmax64(&zipf2()), 1e-6, "mu 1200");
}

#[test]
fn mirostat_v2_truncates_by_surprise_and_keeps_at_least_one() {
    // probs [0.125, 0.5, 0.25, 0.125]: surprises 3, 1, 2, 3 bits.
    let row = ln_row(&[0.125, 0.5, 0.25, 0.125]);
    let dist = |tau: f64| {
        chain(Selection::mirostat_v2(tau, 0.1, Some(1)))
            .distribution(&row, &ctx_at(0))
            .unwrap()
    };
    // tau 1.25, mu 2.5: keeps surprises <= 2.5 (ids 1, 2) -> [0, 2/3, 1/3, 0].
    assert_close(
        &dist(1.25),
        &[0.0, 2.0 / 3.0, 1.0 / 3.0, 0.0],
        1e-6,
        "mu 2.5",
    );
    // tau 1.75, mu 3.5: everything.
    assert_close(&dist(1.75), &[0.125, 0.5, 0.25, 0.125], 1e-6, "mu 3.5");
    // tau 0.25, mu 0.5: nothing (1 > 0.5): the most probable, id 1, alone.
    assert_close(&dist(0.25), &[0.0, 1.0, 0.0, 0.0], 0.0, "mu 0.5");
    // Tied most probable and nothing kept: the lower id.
    let d = chain(Selection::mirostat_v2(0.25, 0.1, Some(1)))
        .distribution(&ln_row(&[0.2, 0.4, 0.4]), &ctx_at(0))
        .unwrap();
    assert_close(&d, &[0.0, 1.0, 0.0], 0.0, "tie");
}

#[test]
fn mirostat_mu_moves_on_accept_by_the_surprise_of_the_accepted_token() {
    // v2, tau 2, eta 0.5: mu starts at 4. Rows of k equal logits have p = 1/k exactly.
    let mut c = chain(Selection::mirostat_v2(2.0, 0.5, Some(11)));
    assert_eq!(c.mirostat_mu(), Some(4.0));
    // 4 equal: surprise 2 <= 4, all kept; accepting one: mu -= 0.5 (2 - 2) -> 4.
    let t = c.sample(&[0.0; 4], &ctx_at(0), 0).unwrap().token;
    c.accept(t);
    assert_eq!(c.mirostat_mu(), Some(4.0));
    // 8 equal: surprise 3 <= 4; mu -= 0.5 (3 - 2) -> 3.5.
    let t = c.sample(&[0.0; 8], &ctx_at(1), 0).unwrap().token;
    c.accept(t);
    assert_eq!(c.mirostat_mu(), Some(3.5));
    // 16 equal: surprise 4 > 3.5, none kept: id 0 alone, p = 1; mu -= 0.5 (0 - 2) -> 4.5.
    let out = c.sample(&[0.0; 16], &ctx_at(2), 0).unwrap();
    assert_eq!((out.token, out.logprob), (0, 0.0));
    c.accept(0);
    assert_eq!(c.mirostat_mu(), Some(4.5));
    // 16 equal again: 4 <= 4.5, all kept; mu -= 0.5 (4 - 2) -> 3.5.
    let t = c.sample(&[0.0; 16], &ctx_at(3), 0).unwrap().token;
    c.accept(t);
    assert_eq!(c.mirostat_mu(), Some(3.5));

    // v1 on the Zipf row, tau 1.9, eta 0.1: k = 3, p(1) = 9/49; accepting 1:
    // mu = 3.8 - 0.1 (log2(49/9) - 1.9) = 3.8 - 0.1 (2.444785 - 1.9) = 3.745522.
    let mut c = chain(Selection::mirostat(1.9, 0.1, 100, Some(1)));
    c.distribution(&zipf2(), &ctx_at(0)).unwrap();
    c.accept(1);
    let want = 3.8 - 0.1 * ((49.0f64 / 9.0).log2() - 1.9);
    assert!((c.mirostat_mu().unwrap() - want).abs() < 1e-6);
    assert!((want - 3.745_522).abs() < 1e-6, "the hand value");
}

#[test]
fn mirostat_accept_outside_the_distribution_or_without_one_leaves_mu() {
    // probs [0.125, 0.5, 0.25, 0.125], mu 2.5 keeps ids 1, 2.
    let row = ln_row(&[0.125, 0.5, 0.25, 0.125]);
    let mut c = chain(Selection::mirostat_v2(1.25, 0.5, Some(1)));
    // No distribution yet (a prompt token): unchanged.
    c.accept(1);
    assert_eq!(c.mirostat_mu(), Some(2.5));
    // Token 3 is outside the truncated distribution: unchanged, and the distribution is
    // consumed, so a following accept of 1 changes nothing either.
    c.distribution(&row, &ctx_at(0)).unwrap();
    c.accept(3);
    c.accept(1);
    assert_eq!(c.mirostat_mu(), Some(2.5));
    // An id beyond the row: unchanged.
    c.distribution(&row, &ctx_at(0)).unwrap();
    c.accept(40);
    assert_eq!(c.mirostat_mu(), Some(2.5));
    // A token inside: p(2) = 1/3, surprise log2 3; mu = 2.5 - 0.5 (log2 3 - 1.25).
    c.distribution(&row, &ctx_at(0)).unwrap();
    c.accept(2);
    let want = 2.5 - 0.5 * (3f64.log2() - 1.25);
    assert!((c.mirostat_mu().unwrap() - want).abs() < 1e-6);
    // A failed call leaves nothing pending.
    c.distribution(&row, &ctx_at(0)).unwrap();
    assert!(c.distribution(&[NEG; 4], &ctx_at(0)).is_err());
    c.accept(2);
    assert!((c.mirostat_mu().unwrap() - want).abs() < 1e-6);
}

#[test]
fn mirostat_reset_and_clone() {
    let row = zipf2();
    let run = |c: &mut SamplerChain, tokens: &[u32]| {
        for (pos, &t) in tokens.iter().enumerate() {
            c.distribution(&row, &ctx_at(pos as u64)).unwrap();
            c.accept(t);
        }
    };
    let mut a = chain(Selection::mirostat(2.5, 0.2, 100, Some(5)));
    let mut witness = a.clone();
    run(&mut a, &[0, 1, 0]);
    run(&mut witness, &[0, 1, 0]);
    let mut b = a.clone();
    assert_eq!(b.mirostat_mu(), a.mirostat_mu(), "the clone copies mu");
    // Diverge: the clone takes rarer tokens, its mu falls (more surprise) independently.
    run(&mut a, &[0, 0]);
    run(&mut witness, &[0, 0]);
    run(&mut b, &[1, 1]);
    assert_eq!(
        a.mirostat_mu(),
        witness.mirostat_mu(),
        "the original is unaffected"
    );
    assert!(b.mirostat_mu().unwrap() < a.mirostat_mu().unwrap());
    // A pending distribution is cloned too.
    a.distribution(&row, &ctx_at(9)).unwrap();
    let mut c = a.clone();
    c.accept(0);
    a.accept(0);
    assert_eq!(c.mirostat_mu(), a.mirostat_mu());
    // Reset: back to 2 tau, nothing pending.
    a.distribution(&row, &ctx_at(9)).unwrap();
    a.reset(&[]);
    assert_eq!(a.mirostat_mu(), Some(5.0));
    a.accept(0);
    assert_eq!(a.mirostat_mu(), Some(5.0));
    // set_selection starts afresh too; other selections have no mu.
    b.set_selection(Selection::mirostat_v2(1.0, 0.2, None));
    assert_eq!(b.mirostat_mu(), Some(2.0));
    assert_eq!(chain(Selection::sample(None)).mirostat_mu(), None);
}

#[test]
fn mirostat_matches_the_f64_oracle_on_random_rows() {
    let mut g = SplitMix(0x31205);
    let mut checked = [0usize; 2];
    for &n in &[2usize, 3, 9, 111, 1000, 32_000] {
        for r in 0..30 {
            let row = random_row(&mut g, n, [0.7, 1.5, 3.0][r % 3]);
            let mu = 1.0 + 12.0 * g.next_f64();
            let m = [2usize, 5, 100, 100_000][g.below(4) as usize];
            let tau = mu / 2.0;
            // v1
            let (k_real, want) = mirostat_v1_oracle(&row, m, mu);
            let near_integer = (k_real - k_real.round()).abs() <= 1e-6 * k_real.max(1.0);
            if !near_integer {
                let mut c = chain(Selection::mirostat(tau, 0.1, m, Some(1)));
                let d = c.distribution(&row, &ctx_at(0)).unwrap();
                assert_close(&d, &want, 1e-6, &format!("v1 n {n} row {r} m {m} mu {mu}"));
                // The stateless function is the chain's.
                let pairs =
                    mirostat_distribution(&row, &Mirostat::v1(tau, 0.1, m).unwrap(), mu).unwrap();
                for (id, p) in &pairs {
                    assert_eq!(*p, d[*id as usize]);
                }
                assert_eq!(pairs.len(), support(&d).len());
                checked[0] += 1;
            }
            // v2
            let (want, fragile) = mirostat_v2_oracle(&row, mu);
            if !fragile {
                let d = chain(Selection::mirostat_v2(tau, 0.1, Some(1)))
                    .distribution(&row, &ctx_at(0))
                    .unwrap();
                assert_close(&d, &want, 1e-6, &format!("v2 n {n} row {r} mu {mu}"));
                checked[1] += 1;
            }
        }
    }
    assert!(checked[0] > 150 && checked[1] > 150, "{checked:?}");
}

#[test]
fn mirostat_sampling_follows_the_truncated_distribution() {
    // Exact draws: with margin, the token is the inverse CDF (id order) of the oracle's
    // truncated distribution at the spec's uniform (seed, position, sample_index).
    // tau 4, mu 8: v1 keeps 56 of the 300 tokens (k = 56.9), v2 60.
    let row = common::normal_row(21, 300, 1.5);
    let (k_real, want) = mirostat_v1_oracle(&row, 100, 8.0);
    assert_eq!(k_real as usize, 56);
    let mut c = chain(Selection::mirostat(4.0, 0.1, 100, Some(77)));
    for pos in 0..200u64 {
        let out = c.sample(&row, &ctx_at(pos), 2).unwrap();
        if let Some(t) = inverse_cdf(&want, spec_uniform(77, pos, 2), 1e-6) {
            assert_eq!(out.token, t, "position {pos}");
        }
        assert!((out.logprob - want[out.token as usize].ln()).abs() < 1e-6);
        assert_eq!(out.num_candidates, support(&want).len());
    }

    // Chi-square, v1 and v2, mu fixed (no accept), alpha 1e-6 each.
    for (name, sel, want) in [
        ("v1", Selection::mirostat(4.0, 0.1, 100, Some(5)), want),
        (
            "v2",
            Selection::mirostat_v2(4.0, 0.1, Some(6)),
            mirostat_v2_oracle(&row, 8.0).0,
        ),
    ] {
        assert!(support(&want).len() > 5, "{name}: a real truncation");
        let mut c = chain(sel);
        let mut counts = vec![0u64; row.len()];
        for pos in 0..20_000u64 {
            counts[c.sample(&row, &ctx_at(pos), 0).unwrap().token as usize] += 1;
        }
        let cs = chi_square_test(&counts, &want, ALPHA);
        assert_eq!(cs.outside_support, 0, "{name}");
        assert!(cs.statistic < cs.critical, "{name}: {cs:?}");
    }
}

#[test]
fn mirostat_mu_trajectory_matches_the_oracle() {
    // Sample-accept loop; each step's mu follows from the oracle's distribution at the
    // previous mu and the accepted token.
    let mut g = SplitMix(4);
    let rows: Vec<Vec<f32>> = (0..40).map(|_| random_row(&mut g, 500, 2.0)).collect();
    for v2 in [false, true] {
        let (tau, eta) = (3.0, 0.3);
        let sel = if v2 {
            Selection::mirostat_v2(tau, eta, Some(8))
        } else {
            Selection::mirostat(tau, eta, 100, Some(8))
        };
        let mut c = chain(sel);
        let mut mu = 2.0 * tau;
        for (pos, row) in rows.iter().enumerate() {
            let want = if v2 {
                mirostat_v2_oracle(row, mu).0
            } else {
                mirostat_v1_oracle(row, 100, mu).1
            };
            let t = c.sample(row, &ctx_at(pos as u64), 0).unwrap().token;
            assert!(want[t as usize] > 0.0);
            c.accept(t);
            mu -= eta * (-want[t as usize].log2() - tau);
            assert!(
                (c.mirostat_mu().unwrap() - mu).abs() < 1e-5,
                "v2 {v2} step {pos}"
            );
        }
    }
    // The stateless update.
    assert_eq!(mirostat_update(4.0, 0.125, 2.0, 0.5), 3.5);
    assert_eq!(Mirostat::v2(2.0, 0.5).unwrap().update(4.0, 0.25), 4.0);
}

#[test]
fn mirostat_logprobs_and_n_come_from_the_truncated_distribution() {
    let row = zipf2();
    let mut c = chain(Selection::Mirostat {
        tau: 1.9,
        eta: 0.1,
        m: 100,
        seed: Some(3),
        n: 4,
        logprobs: Some(4),
        logprobs_kind: LogprobsKind::Processed,
    });
    let out = c.sample(&row, &ctx_at(0), 0).unwrap();
    let lp = out.logprobs.unwrap();
    let want = [36.0f64 / 49.0, 9.0 / 49.0, 4.0 / 49.0];
    for (j, w) in want.iter().enumerate() {
        assert_eq!(lp.top[j].token_id, j as u32);
        assert!((lp.top[j].logprob - w.ln()).abs() < 1e-6);
    }
    assert_eq!(lp.top[3].logprob, f64::NEG_INFINITY);
    assert_eq!(out.extra_samples.len(), 3);
    assert!(out.extra_samples.iter().all(|s| s.token < 3));
}

#[test]
fn mirostat_parameter_errors_name_the_field() {
    let row = [0.0f32, 1.0];
    for (sel, field) in [
        (Selection::mirostat(-1.0, 0.1, 100, Some(1)), "mirostat_tau"),
        (
            Selection::mirostat(f64::NAN, 0.1, 100, Some(1)),
            "mirostat_tau",
        ),
        (Selection::mirostat(5.0, -0.1, 100, Some(1)), "mirostat_eta"),
        (
            Selection::mirostat(5.0, f64::INFINITY, 100, Some(1)),
            "mirostat_eta",
        ),
        (Selection::mirostat(5.0, 0.1, 1, Some(1)), "mirostat_m"),
        (Selection::mirostat(5.0, 0.1, 0, Some(1)), "mirostat_m"),
        (
            Selection::mirostat_v2(f64::INFINITY, 0.1, Some(1)),
            "mirostat_tau",
        ),
        (
            Selection::mirostat_v2(5.0, f64::NAN, Some(1)),
            "mirostat_eta",
        ),
    ] {
        assert_eq!(sel.validate().unwrap_err().field, field);
        let e = chain(sel).sample(&row, &ctx_at(0), 0).unwrap_err();
        assert_eq!(param_field(e), field);
        let e = chain(sel).distribution(&row, &ctx_at(0)).unwrap_err();
        assert_eq!(param_field(e), field);
    }
    assert_eq!(
        Mirostat::v1(5.0, 0.1, 2).unwrap().version(),
        MirostatVersion::V1 { m: 2 }
    );
    // Rows the stateless function refuses.
    let m = Mirostat::v2(5.0, 0.1).unwrap();
    assert!(matches!(
        mirostat_distribution(&[NEG, NEG], &m, 10.0),
        Err(SampleError::NoCandidates)
    ));
    assert!(matches!(
        mirostat_distribution(&[0.0, f32::NAN], &m, 10.0),
        Err(SampleError::NonFiniteLogits { token_id: 1, .. })
    ));
}

// ---------------------------------------------------------------------------------------------
// Adaptive-p
// ---------------------------------------------------------------------------------------------

/// softmax of f64 logits.
fn softmax_f64(l: &[f64]) -> Vec<f64> {
    let max = l.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    let e: Vec<f64> = l.iter().map(|x| (x - max).exp()).collect();
    let z: f64 = e.iter().sum();
    e.iter().map(|x| x / z).collect()
}

#[test]
fn adaptive_p_transform_and_state_by_hand() {
    // probs [0.6, 0.3, 0.1], target 0.3, decay 0: the state starts at (0.3 / 1, 1 / 1), the
    // adapted target is 2 * 0.3 - 0.3 = 0.3. d = |p - 0.3| / 0.3 = 1, 0, 2/3; logits
    // 5 - 10 d^2 / (1 + d) = 5 - 5 = 0, 5, 5 - 10 (4/9) / (5/3) = 5 - 8/3 = 7/3.
    let row = ln_row(&[0.6, 0.3, 0.1]);
    let mut c = chain(Selection::adaptive_p(0.3, 0.0, Some(1)));
    assert_eq!(
        c.adaptive_p_state(),
        Some(AdaptivePState {
            weighted_sum: 0.3,
            total_weight: 1.0
        })
    );
    let d = c.distribution(&row, &ctx_at(0)).unwrap();
    assert_close(&d, &softmax_f64(&[0.0, 5.0, 7.0 / 3.0]), 1e-5, "first step");
    // Accepting token 0 (original p 0.6): weighted_sum = 0.6 + 0 * 0.3, total_weight = 1.
    c.accept(0);
    let s = c.adaptive_p_state().unwrap();
    assert!(
        (s.weighted_sum - 0.6).abs() < 1e-6 && s.total_weight == 1.0,
        "{s:?}"
    );
    // Adapted target 2 * 0.3 - 0.6 = 0: d = 2, 1, 1/3; logits 5 - 40/3 = -25/3, 0,
    // 5 - 10 (1/9) / (4/3) = 5 - 5/6 = 25/6.
    let d = c.distribution(&row, &ctx_at(1)).unwrap();
    assert_close(
        &d,
        &softmax_f64(&[-25.0 / 3.0, 0.0, 25.0 / 6.0]),
        1e-5,
        "second step",
    );

    // decay 0.5: the state starts at (0.3 / 0.5, 1 / 0.5) = (0.6, 2); accepting p 0.6:
    // (0.6 + 0.5 * 0.6, 1 + 0.5 * 2) = (0.9, 2); adapted target 0.6 - 0.45 = 0.15.
    let a = AdaptiveP::new(0.3, 0.5).unwrap();
    let s0 = a.initial_state();
    assert!((s0.weighted_sum - 0.6).abs() < 1e-15 && (s0.total_weight - 2.0).abs() < 1e-15);
    let s1 = a.update(s0, 0.6);
    assert!((s1.weighted_sum - 0.9).abs() < 1e-15 && (s1.total_weight - 2.0).abs() < 1e-15);
    assert!((a.adapted_target(&s1) - 0.15).abs() < 1e-15);
    // Clamped: target 1 with an average of 0.2 would ask for 1.8.
    let a = AdaptiveP::new(1.0, 0.0).unwrap();
    let s = AdaptivePState {
        weighted_sum: 0.2,
        total_weight: 1.0,
    };
    assert_eq!(a.adapted_target(&s), 1.0);
}

#[test]
fn adaptive_p_negative_target_is_plain_sampling_without_state() {
    let row = ln_row(&[0.6, 0.3, 0.1]);
    let mut c = chain(Selection::adaptive_p(-1.0, 0.9, Some(1)));
    let s0 = c.adaptive_p_state().unwrap();
    let d = c.distribution(&row, &ctx_at(0)).unwrap();
    assert_close(&d, &[0.6, 0.3, 0.1], 1e-6, "plain");
    c.accept(0);
    assert_eq!(c.adaptive_p_state().unwrap(), s0);
}

#[test]
fn adaptive_p_accept_reset_and_clone() {
    let row = ln_row(&[0.5, 0.2, 0.2, 0.1]);
    let mut a = chain(Selection::adaptive_p(0.25, 0.9, Some(4)));
    let s0 = a.adaptive_p_state().unwrap();
    // No pending distribution: unchanged.
    a.accept(0);
    assert_eq!(a.adaptive_p_state().unwrap(), s0);
    // Accept token 3 (original p 0.1) after a distribution.
    a.distribution(&row, &ctx_at(0)).unwrap();
    a.accept(3);
    let s1 = a.adaptive_p_state().unwrap();
    assert!((s1.weighted_sum - (0.1 + 0.9 * s0.weighted_sum)).abs() < 1e-6);
    assert!((s1.total_weight - (1.0 + 0.9 * s0.total_weight)).abs() < 1e-12);
    // A removed token is outside the distribution.
    let masked = [row[0], NEG, row[2], row[3]];
    a.distribution(&masked, &ctx_at(1)).unwrap();
    a.accept(1);
    assert_eq!(a.adaptive_p_state().unwrap(), s1);
    // Clone: independent continuation.
    let mut b = a.clone();
    a.distribution(&row, &ctx_at(2)).unwrap();
    a.accept(0);
    b.distribution(&row, &ctx_at(2)).unwrap();
    b.accept(3);
    let (sa, sb) = (a.adaptive_p_state().unwrap(), b.adaptive_p_state().unwrap());
    assert!((sa.weighted_sum - (0.5 + 0.9 * s1.weighted_sum)).abs() < 1e-6);
    assert!((sb.weighted_sum - (0.1 + 0.9 * s1.weighted_sum)).abs() < 1e-6);
    // Reset: the initial state.
    a.reset(&[1, 2]);
    assert_eq!(a.adaptive_p_state().unwrap(), s0);
}

#[test]
fn adaptive_p_matches_the_f64_oracle_on_random_rows() {
    let mut g = SplitMix(0xADA);
    for &n in &[1usize, 2, 7, 111, 1000, 32_000] {
        for r in 0..20 {
            let row = random_row(&mut g, n, [0.5, 1.5, 4.0][r % 3]);
            let target = [-0.5, 0.0, 0.1, 0.3, 0.7, 1.0][g.below(6) as usize];
            let decay = [0.0, 0.5, 0.9, 0.99][g.below(4) as usize];
            // llama.cpp's init: the average starts on target.
            let (mut ws, mut tw) = (target / (1.0 - decay), 1.0 / (1.0 - decay));
            let mut c = chain(Selection::adaptive_p(target, decay, Some(2)));
            // A few accepted steps move the state; check every step against the oracle.
            for step in 0..3u64 {
                let want = adaptive_oracle(&row, target, ws, tw);
                let d = c.distribution(&row, &ctx_at(step)).unwrap();
                assert_close(&d, &want, 1e-6, &format!("n {n} row {r} step {step}"));
                let t = (0..n).rev().find(|&i| row[i] != NEG).unwrap();
                c.accept(t as u32);
                if target >= 0.0 {
                    (ws, tw) = (softmax64(&row)[t] + decay * ws, 1.0 + decay * tw);
                }
                let got = c.adaptive_p_state().unwrap();
                assert!((got.weighted_sum - ws).abs() < 1e-6, "n {n} row {r}");
                assert!((got.total_weight - tw).abs() < 1e-9);
            }
        }
    }
}

#[test]
fn adaptive_p_sampling_chi_square() {
    // 60 tokens, target 0.05, decay 0.9, the initial state (no accept): alpha 1e-6.
    let row = common::normal_row(33, 60, 1.2);
    // Initial state (0.05 / 0.1, 1 / 0.1).
    let want = adaptive_oracle(&row, 0.05, 0.5, 10.0);
    let mut c = chain(Selection::adaptive_p(0.05, 0.9, Some(12)));
    let mut counts = vec![0u64; row.len()];
    for pos in 0..20_000u64 {
        let out = c.sample(&row, &ctx_at(pos), 0).unwrap();
        if pos < 100 {
            if let Some(t) = inverse_cdf(&want, spec_uniform(12, pos, 0), 1e-6) {
                assert_eq!(out.token, t, "position {pos}");
            }
        }
        counts[out.token as usize] += 1;
    }
    let cs = chi_square_test(&counts, &want, ALPHA);
    assert_eq!(cs.outside_support, 0);
    assert!(cs.statistic < cs.critical, "{cs:?}");
}

#[test]
fn adaptive_p_parameter_errors_name_the_field() {
    for (t, d, field) in [
        (1.5, 0.9, "adaptive_target"),
        (f64::NAN, 0.9, "adaptive_target"),
        (f64::NEG_INFINITY, 0.9, "adaptive_target"),
        (0.5, -0.1, "adaptive_decay"),
        (0.5, 0.995, "adaptive_decay"),
        (0.5, f64::NAN, "adaptive_decay"),
    ] {
        assert_eq!(AdaptiveP::new(t, d).unwrap_err().field, field);
        let e = chain(Selection::adaptive_p(t, d, Some(1)))
            .sample(&[0.0, 1.0], &ctx_at(0), 0)
            .unwrap_err();
        assert_eq!(param_field(e), field);
    }
    assert!(AdaptiveP::new(-3.0, 0.99).unwrap().is_off());
}

// ---------------------------------------------------------------------------------------------
// Configuration
// ---------------------------------------------------------------------------------------------

#[test]
fn config_round_trip_defaults_and_errors() {
    let json = r#"[{"xtc": {"threshold": 0.2, "probability": 0.5}},
                   {"xtc": {}},
                   {"mirostat": {"tau": 3, "seed": 7}}]"#;
    let config: Vec<ProcessorConfig> = serde_json::from_str(json).unwrap();
    assert_eq!(
        config[0],
        ProcessorConfig::Xtc {
            threshold: 0.2,
            probability: 0.5,
            min_keep: 1
        }
    );
    assert_eq!(
        config[1],
        ProcessorConfig::Xtc {
            threshold: 0.1,
            probability: 0.0,
            min_keep: 1
        }
    );
    assert_eq!(
        config[2].to_selection(),
        Some(Selection::Mirostat {
            tau: 3.0,
            eta: 0.1,
            m: 100,
            seed: Some(7),
            n: 1,
            logprobs: None,
            logprobs_kind: LogprobsKind::Processed,
        })
    );
    let back: Vec<ProcessorConfig> =
        serde_json::from_str(&serde_json::to_string(&config).unwrap()).unwrap();
    assert_eq!(back, config);
    let c = SamplerChain::from_config(&config).unwrap();
    assert_eq!(c.processors().len(), 2);
    assert_eq!(c.processors()[0].name(), "xtc");
    assert_eq!(c.mirostat_mu(), Some(6.0));

    for (json, want) in [
        (
            r#"{"mirostat_v2": {"eta": 0.2}}"#,
            Selection::MirostatV2 {
                tau: 5.0,
                eta: 0.2,
                seed: None,
                n: 1,
                logprobs: None,
                logprobs_kind: LogprobsKind::Processed,
            },
        ),
        (
            r#"{"adaptive_p": {"target": 0.4, "seed": 3, "n": 2, "logprobs": 1}}"#,
            Selection::AdaptiveP {
                target: 0.4,
                decay: 0.9,
                seed: Some(3),
                n: 2,
                logprobs: Some(1),
                logprobs_kind: LogprobsKind::Processed,
            },
        ),
    ] {
        let entry: ProcessorConfig = serde_json::from_str(json).unwrap();
        assert!(entry.is_selection());
        assert_eq!(entry.to_selection(), Some(want), "{json}");
        let again: ProcessorConfig =
            serde_json::from_str(&serde_json::to_string(&entry).unwrap()).unwrap();
        assert_eq!(again, entry);
    }

    // A mirostat entry before the last is SelectionNotLast.
    let config: Vec<ProcessorConfig> =
        serde_json::from_str(r#"[{"mirostat": {}}, {"sample": {}}]"#).unwrap();
    assert_eq!(
        SamplerChain::from_config(&config).unwrap_err(),
        ChainError::SelectionNotLast {
            index: 0,
            name: "mirostat"
        }
    );
    let config: Vec<ProcessorConfig> =
        serde_json::from_str(r#"[{"adaptive_p": {"target": 0.5}}, {"xtc": {}}]"#).unwrap();
    assert!(matches!(
        SamplerChain::from_config(&config).unwrap_err(),
        ChainError::SelectionNotLast {
            index: 0,
            name: "adaptive_p"
        }
    ));
    // XTC last: no selection.
    let config: Vec<ProcessorConfig> = serde_json::from_str(r#"[{"xtc": {}}]"#).unwrap();
    assert_eq!(
        SamplerChain::from_config(&config).unwrap_err(),
        ChainError::NoSelection
    );
    // Out-of-range values reach validation and name the field.
    for (json, index, name, field) in [
        (
            r#"[{"xtc": {"threshold": "nan"}}, {"greedy": {}}]"#,
            0,
            "xtc",
            "xtc_threshold",
        ),
        (
            r#"[{"xtc": {"probability": 2}}, {"greedy": {}}]"#,
            0,
            "xtc",
            "xtc_probability",
        ),
        (
            r#"[{"mirostat": {"tau": "inf"}}]"#,
            0,
            "mirostat",
            "mirostat_tau",
        ),
        (r#"[{"mirostat": {"m": 1}}]"#, 0, "mirostat", "mirostat_m"),
        (
            r#"[{"top_k": {"k": 3}}, {"mirostat_v2": {"eta": -1}}]"#,
            1,
            "mirostat_v2",
            "mirostat_eta",
        ),
        (
            r#"[{"adaptive_p": {"target": 0.5, "decay": 1}}]"#,
            0,
            "adaptive_p",
            "adaptive_decay",
        ),
    ] {
        let config: Vec<ProcessorConfig> = serde_json::from_str(json).unwrap();
        match SamplerChain::from_config(&config).unwrap_err() {
            ChainError::InvalidParams {
                index: i,
                name: nm,
                source,
            } => assert_eq!((i, nm, source.field), (index, name, field), "{json}"),
            other => panic!("{json}: {other:?}"),
        }
    }
    // Unknown fields and a missing adaptive-p target are parse errors.
    for json in [
        r#"{"xtc": {"threshold": 0.1, "seed": 1}}"#,
        r#"{"mirostat_v2": {"m": 100}}"#,
        r#"{"adaptive_p": {"decay": 0.9}}"#,
    ] {
        assert!(
            serde_json::from_str::<ProcessorConfig>(json).is_err(),
            "{json}"
        );
    }
}
