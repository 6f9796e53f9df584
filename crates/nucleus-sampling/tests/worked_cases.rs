//! The worked cases of spec/sampling.md that the `SamplingParams` API reaches, as exact tests
//! of `distribution()`, `sample_row()` and `sample_batch()`, plus the edge rules of the spec
//! (errors, padding, shapes, seeds, Philox known answers).
//!
//! Not reachable yet (the API lacks the inputs): probability input (so the exact top-p boundary
//! case), frequency/presence penalties (the `[1, 1, 1]` case), f16 input (the f16 case is run
//! with the same values as f32), min_p, logit bias, allowed ids, bad words, min_tokens, n > 1
//! (only `sample_index` is there), top-n logprobs.

mod common;

use common::oracle::{oracle, Oracle, OracleError};
use common::{
    assert_close, inverse_cdf, ln_row, normal_row, reference_philox4x32_10, spec_uniform,
    uniform_from_words, SplitMix,
};
use nucleus_sampling::philox::{philox4x32_10, uniform};
use nucleus_sampling::{
    distribution, sample_batch, sample_row, LogitsView, ParamError, SampleError, SampleOutput,
    SampleRequest, SamplingParams, ShapeError,
};

fn params(temperature: f64, top_k: i64, top_p: f64, seed: u64) -> SamplingParams {
    SamplingParams {
        temperature,
        top_k,
        top_p,
        repetition_penalty: 1.0,
        seed: Some(seed),
        ..Default::default()
    }
}

fn dist(row: &[f32], p: &SamplingParams) -> Vec<f64> {
    distribution(row, &SampleRequest::new(p, &[], &[], 0)).expect("distribution")
}

fn sample(row: &[f32], p: &SamplingParams, position: u64) -> SampleOutput {
    sample_row(row, &SampleRequest::new(p, &[], &[], position)).expect("sample_row")
}

fn softmax(logits: &[f64]) -> Vec<f64> {
    let m = logits.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    let w: Vec<f64> = logits.iter().map(|l| (l - m).exp()).collect();
    let s: f64 = w.iter().sum();
    w.iter().map(|x| x / s).collect()
}

fn oracle_of(row: &[f32], p: &SamplingParams) -> Oracle {
    oracle(row, p, &[], &[]).expect("oracle")
}

/// The spec's expected probabilities, checked against the oracle (so the oracle is checked on
/// every worked case) and against `distribution()`; then `sample_row` over many positions must
/// pick exactly the token step 11 picks from those probabilities, report its logprob and the
/// number of candidates.
#[track_caller]
fn check_case(row: &[f32], p: &SamplingParams, want: &[f64], what: &str) {
    let o = oracle_of(row, p);
    assert_close(&o.probs, want, 1e-6, &format!("{what} (oracle)"));
    let got = dist(row, p);
    assert_close(&got, want, 1e-6, &format!("{what} (distribution)"));
    let support = want.iter().filter(|&&x| x > 0.0).count();
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        if w == 0.0 {
            assert_eq!(
                g, 0.0,
                "{what}: removed token {i} must have probability exactly 0"
            );
        }
    }
    let seed = p.seed.expect("worked cases are seeded");
    for position in 0..300u64 {
        let out = sample(row, p, position);
        assert_eq!(out.seed, seed, "{what}: reported seed");
        assert_eq!(out.num_candidates, support, "{what}: num_candidates");
        let t = out.token as usize;
        assert!(want[t] > 0.0, "{what}: token {t} has probability 0");
        if p.temperature < 1e-5 {
            assert_eq!(out.logprob, 0.0, "{what}: greedy logprob");
        } else {
            assert!(
                (out.logprob - want[t].ln()).abs() <= 1e-6,
                "{what}: logprob {} vs ln p = {}",
                out.logprob,
                want[t].ln()
            );
        }
        let u = spec_uniform(seed, position, 0);
        if let Some(expected) = inverse_cdf(want, u, 1e-5) {
            assert_eq!(out.token, expected, "{what}: position {position}, u = {u}");
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Philox and the uniform.

const KNOWN_ANSWERS: [([u32; 4], [u32; 2], [u32; 4]); 3] = [
    (
        [0, 0, 0, 0],
        [0, 0],
        [0x6627_e8d5, 0xe169_c58d, 0xbc57_ac4c, 0x9b00_dbd8],
    ),
    (
        [u32::MAX; 4],
        [u32::MAX; 2],
        [0x408f_276d, 0x41c8_3b0e, 0xa20b_c7c6, 0x6d54_51fd],
    ),
    (
        [0x243f_6a88, 0x85a3_08d3, 0x1319_8a2e, 0x0370_7344],
        [0xa409_3822, 0x299f_31d0],
        [0xd16c_fe09, 0x94fd_cceb, 0x5001_e420, 0x2412_6ea1],
    ),
];

#[test]
fn philox_known_answers_from_random123() {
    for (counter, key, want) in KNOWN_ANSWERS {
        assert_eq!(
            philox4x32_10(counter, key),
            want,
            "counter {counter:08x?} key {key:08x?}"
        );
        // The test's own reference, used below on other counters, passes them too.
        assert_eq!(reference_philox4x32_10(counter, key), want);
    }
}

#[test]
fn philox_matches_reference_on_random_counters() {
    let mut g = SplitMix(0x5EED);
    for _ in 0..2000 {
        let c = [
            g.next_u64() as u32,
            g.next_u64() as u32,
            g.next_u64() as u32,
            g.next_u64() as u32,
        ];
        let k = [g.next_u64() as u32, g.next_u64() as u32];
        assert_eq!(
            philox4x32_10(c, k),
            reference_philox4x32_10(c, k),
            "{c:08x?} {k:08x?}"
        );
    }
}

#[test]
fn uniform_follows_the_spec_formula() {
    // Seed 0, position 0, sample 0 is the all-zero known answer: w0 = 6627e8d5, w1 = e169c58d.
    let x = 0x6627_e8d5_e169_c58d_u64 >> 11;
    let want = (x as f64 + 0.5) / 2f64.powi(53);
    assert_eq!(uniform(0, 0, 0).to_bits(), want.to_bits());

    let mut g = SplitMix(99);
    let mut cases = vec![
        (0u64, 0u64, 0u32),
        (42, 7, 0),
        (42, 7, 1),
        (0xDEAD_BEEF_1234_5678, (1 << 40) + 5, 7),
        (u64::MAX, u64::MAX, u32::MAX),
        (1 << 32, 1 << 32, 0), // high words only: key (0, 1), counter (0, 1, 0, 0)
    ];
    for _ in 0..500 {
        cases.push((g.next_u64(), g.next_u64(), g.next_u64() as u32));
    }
    for (seed, position, index) in cases {
        let u = uniform(seed, position, index);
        // Spec formula over the reference Philox, independent of the implementation.
        let w = reference_philox4x32_10(
            [position as u32, (position >> 32) as u32, index, 0],
            [seed as u32, (seed >> 32) as u32],
        );
        assert_eq!(
            u.to_bits(),
            uniform_from_words(w).to_bits(),
            "uniform({seed}, {position}, {index})"
        );
        assert_eq!(u.to_bits(), spec_uniform(seed, position, index).to_bits());
        assert!(u > 0.0 && u < 1.0);
    }
    // Each of seed, position and sample index changes the draw.
    assert_ne!(uniform(42, 7, 0), uniform(43, 7, 0));
    assert_ne!(uniform(42, 7, 0), uniform(42, 8, 0));
    assert_ne!(uniform(42, 7, 0), uniform(42, 7, 1));
    assert_ne!(uniform(1, 0, 0), uniform(1 << 32, 0, 0));
    assert_ne!(uniform(0, 1, 0), uniform(0, 1 << 32, 0));
}

// ---------------------------------------------------------------------------------------------
// Greedy and top-k.

#[test]
fn greedy_ties_go_to_the_lowest_id() {
    let g = SamplingParams {
        seed: Some(5),
        ..SamplingParams::greedy()
    };
    check_case(&[5.0, 5.0, 1.0], &g, &[1.0, 0.0, 0.0], "[5,5,1] greedy");
    check_case(
        &[1.0, 7.0, 3.0, 7.0],
        &g,
        &[0.0, 1.0, 0.0, 0.0],
        "[1,7,3,7] greedy",
    );
    check_case(
        &[f32::NEG_INFINITY, 2.0, 2.0],
        &g,
        &[0.0, 1.0, 0.0],
        "[-inf,2,2] greedy",
    );
    check_case(&[-3.0], &g, &[1.0], "single token greedy");
}

#[test]
fn temperature_below_1e_5_is_greedy_and_1e_5_is_not() {
    let row = [5.0f32, 5.0, 1.0];
    check_case(&row, &params(0.0, 0, 1.0, 1), &[1.0, 0.0, 0.0], "T = 0");
    check_case(
        &row,
        &params(9.9e-6, 0, 1.0, 1),
        &[1.0, 0.0, 0.0],
        "T = 9.9e-6",
    );
    // At T = 1e-5 the tie is sampled: [0.5, 0.5, exp(-4e5) = 0].
    check_case(&row, &params(1e-5, 0, 1.0, 1), &[0.5, 0.5, 0.0], "T = 1e-5");
    let tokens: std::collections::BTreeSet<u32> = (0..200)
        .map(|pos| sample(&row, &params(1e-5, 0, 1.0, 1), pos).token)
        .collect();
    assert_eq!(tokens, [0, 1].into_iter().collect());
}

#[test]
fn top_k_1_equals_greedy() {
    check_case(
        &[5.0, 5.0, 1.0],
        &params(1.0, 1, 1.0, 3),
        &[1.0, 0.0, 0.0],
        "[5,5,1] top_k 1",
    );
    // Random rows with deliberate ties: top_k 1 at any temperature is the greedy token.
    let mut g = SplitMix(17);
    for trial in 0..200u64 {
        let n = 1 + g.below(40) as usize;
        let row: Vec<f32> = (0..n).map(|_| g.below(4) as f32 - 1.0).collect();
        let greedy = sample(&row, &SamplingParams::greedy(), 0).token;
        let first_max = row
            .iter()
            .enumerate()
            .fold((0, f32::NEG_INFINITY), |(bi, bv), (i, &v)| {
                if v > bv {
                    (i, v)
                } else {
                    (bi, bv)
                }
            })
            .0 as u32;
        assert_eq!(greedy, first_max, "greedy on {row:?}");
        for t in [0.3, 1.0, 50.0] {
            let p = params(t, 1, 1.0, trial);
            let out = sample(&row, &p, trial);
            assert_eq!(out.token, first_max, "top_k 1, T {t} on {row:?}");
            assert_eq!(out.num_candidates, 1);
            assert!(
                out.logprob.abs() <= 1e-12,
                "logprob of a one-hot: {}",
                out.logprob
            );
            let mut one_hot = vec![0.0; n];
            one_hot[first_max as usize] = 1.0;
            assert_close(&dist(&row, &p), &one_hot, 1e-12, "top_k 1 distribution");
        }
    }
}

#[test]
fn top_k_3_of_1_2_2_2_3_keeps_4_1_2() {
    let row = [1.0f32, 2.0, 2.0, 2.0, 3.0];
    let s = softmax(&[2.0, 2.0, 3.0]);
    check_case(
        &row,
        &params(1.0, 3, 1.0, 11),
        &[0.0, s[0], s[1], 0.0, s[2]],
        "[1,2,2,2,3] top_k 3",
    );
}

#[test]
fn top_k_zero_minus_one_or_at_least_vocab_is_off() {
    let row = [0.3f32, -1.2, 2.5, 0.0, 1.1];
    let want = softmax(&row.map(f64::from));
    for k in [0, -1, 5, 6, 1000, i64::MAX] {
        check_case(&row, &params(1.0, k, 1.0, 21), &want, &format!("top_k {k}"));
    }
    // And one below the vocabulary is not off.
    let cut = dist(&row, &params(1.0, 4, 1.0, 21));
    assert_eq!(cut[1], 0.0, "top_k 4 drops the smallest logit");
}

// ---------------------------------------------------------------------------------------------
// The spec's probability cases, as logits ln p (the API has no probability input yet).

#[test]
fn probs_04_03_02_01_top_k_2() {
    let row = ln_row(&[0.4, 0.3, 0.2, 0.1]);
    check_case(
        &row,
        &params(1.0, 2, 1.0, 1),
        &[4.0 / 7.0, 3.0 / 7.0, 0.0, 0.0],
        "top_k 2",
    );
}

#[test]
fn probs_04_03_02_01_top_p_08() {
    let row = ln_row(&[0.4, 0.3, 0.2, 0.1]);
    check_case(
        &row,
        &params(1.0, 0, 0.8, 1),
        &[4.0 / 9.0, 3.0 / 9.0, 2.0 / 9.0, 0.0],
        "top_p 0.8",
    );
}

#[test]
fn probs_04_03_02_01_top_k_2_then_top_p_05() {
    // 4/7 >= 0.5 after renormalising over the top-2: only token 0.
    let row = ln_row(&[0.4, 0.3, 0.2, 0.1]);
    check_case(
        &row,
        &params(1.0, 2, 0.5, 1),
        &[1.0, 0.0, 0.0, 0.0],
        "top_k 2, top_p 0.5",
    );
}

#[test]
fn probs_quarter_eighth_eighth_half_top_p_near_075() {
    // The spec's exact case (top_p 0.75: the prefix {3, 0} reaches 0.75 exactly and takes
    // nothing more) waits for probability input: with f32 logits ln p the prefix mass is
    // 0.75 only up to rounding, and either side is correct. Nearby non-boundary variants:
    let row = ln_row(&[0.25, 0.125, 0.125, 0.5]);
    // 0.74: {3, 0} (mass 0.75) is the shortest prefix.
    check_case(
        &row,
        &params(1.0, 0, 0.74, 1),
        &[1.0 / 3.0, 0.0, 0.0, 2.0 / 3.0],
        "top_p 0.74",
    );
    // 0.76: one of the tied 0.125s joins, the lower id (1): [2/7, 1/7, 0, 4/7].
    check_case(
        &row,
        &params(1.0, 0, 0.76, 1),
        &[2.0 / 7.0, 1.0 / 7.0, 0.0, 4.0 / 7.0],
        "top_p 0.76",
    );
}

// ---------------------------------------------------------------------------------------------
// Repetition penalty.

#[test]
fn repetition_penalty_2_over_seen_0_and_1() {
    // [2, -1, 0.5], seen ids {0, 1} (id 1 twice), r = 2 -> [1, -2, 0.5].
    let row = [2.0f32, -1.0, 0.5];
    let prompt = [1u32];
    let output = [0u32, 1];
    let p = SamplingParams {
        repetition_penalty: 2.0,
        seed: Some(8),
        ..Default::default()
    };
    let want = softmax(&[1.0, -2.0, 0.5]);
    let o = oracle(&row, &p, &prompt, &output).expect("oracle");
    assert_close(&o.probs, &want, 1e-12, "oracle");
    let req = SampleRequest::new(&p, &prompt, &output, 3);
    let got = distribution(&row, &req).expect("distribution");
    assert_close(
        &got,
        &want,
        1e-6,
        "distribution, penalised [1,-2,0.5] at T = 1",
    );
    // Greedy follows the penalised logits.
    let g = SamplingParams {
        temperature: 0.0,
        ..p.clone()
    };
    let out = sample_row(&row, &SampleRequest::new(&g, &prompt, &output, 3)).expect("greedy");
    assert_eq!(out.token, 0);
}

/// (logits, prompt ids, output ids, repetition penalty, greedy token).
type PenaltyCase = (&'static [f32], &'static [u32], &'static [u32], f64, u32);

#[test]
fn repetition_penalty_decides_greedy_and_counts_each_id_once() {
    let cases: [PenaltyCase; 5] = [
        // 2 / 2 = 1 < 1.5: token 1.
        (&[2.0, 1.5, 0.5], &[0], &[], 2.0, 1),
        // -1 * 2 = -2 < -1.5: token 1.
        (&[-1.0, -1.5], &[], &[0], 2.0, 1),
        // Seen three times, penalised once: -1.2 > -1.5 (three times would be -1.728): token 0.
        (&[-1.0, -1.5], &[0, 0], &[0], 1.2, 0),
        // Positive: 3 / 1.5 = 2 > 1.9 once (three times: 0.89): token 0.
        (&[3.0, 1.9], &[0], &[0, 0], 1.5, 0),
        // r < 1 boosts: 1 / 0.5 = 2 > 1.5.
        (&[1.0, 1.5], &[0], &[], 0.5, 0),
    ];
    for (row, prompt, output, r, want) in cases {
        let g = SamplingParams {
            repetition_penalty: r,
            ..SamplingParams::greedy()
        };
        let out = sample_row(row, &SampleRequest::new(&g, prompt, output, 0)).expect("sample_row");
        assert_eq!(
            out.token, want,
            "{row:?} prompt {prompt:?} output {output:?} r {r}"
        );
        let o = oracle(row, &g, prompt, output).expect("oracle");
        assert_eq!(o.probs[want as usize], 1.0, "oracle agrees");
        // At temperature 1, the distribution is the softmax of the penalised logits.
        let t1 = SamplingParams {
            temperature: 1.0,
            ..g.clone()
        };
        let o1 = oracle(row, &t1, prompt, output).expect("oracle");
        let d = distribution(row, &SampleRequest::new(&t1, prompt, output, 0)).expect("dist");
        assert_close(
            &d,
            &softmax(&o1.penalised),
            1e-6,
            "softmax of penalised logits",
        );
    }
}

// ---------------------------------------------------------------------------------------------
// Extreme values.

#[test]
fn large_logits_at_temperature_1e_4_choose_token_0_without_nan() {
    // The spec's f16 case [10, 9, -5] (run as f32: the API takes f32), and f16-range values.
    for row in [[10.0f32, 9.0, -5.0], [60000.0, 59999.0, -60000.0]] {
        for t in [1e-4, 1e-5] {
            let p = params(t, 0, 1.0, 77);
            let d = dist(&row, &p);
            assert!(d.iter().all(|x| x.is_finite()), "{row:?} T {t}: {d:?}");
            assert_close(&d, &[1.0, 0.0, 0.0], 1e-6, "large logits");
            for pos in 0..50 {
                let out = sample(&row, &p, pos);
                assert_eq!(out.token, 0);
                assert!(out.logprob.is_finite() && out.logprob.abs() <= 1e-6);
            }
        }
    }
    // High temperature flattens but stays finite.
    let d = dist(&[60000.0, -60000.0], &params(1e6, 0, 1.0, 1));
    assert_close(&d, &softmax(&[0.06, -0.06]), 1e-6, "T = 1e6");
}

#[test]
fn negative_infinity_masks_and_is_never_chosen() {
    let ninf = f32::NEG_INFINITY;
    let row = [ninf, 0.0, ninf, 0.0, ninf];
    check_case(
        &row,
        &params(1.0, 0, 1.0, 4),
        &[0.0, 0.5, 0.0, 0.5, 0.0],
        "masked",
    );
    check_case(
        &row,
        &params(3.0, 4, 0.3, 4),
        &[0.0, 1.0, 0.0, 0.0, 0.0],
        "masked, top_p 0.3",
    );
    // top_k larger than the candidates: the survivors are the finite ones.
    check_case(
        &row,
        &params(1.0, 3, 1.0, 4),
        &[0.0, 0.5, 0.0, 0.5, 0.0],
        "masked, top_k 3",
    );
}

// ---------------------------------------------------------------------------------------------
// Per-row errors.

fn is_non_finite(r: &Result<SampleOutput, SampleError>, id: u32, inf: bool) -> bool {
    matches!(r, Err(SampleError::NonFiniteLogits { token_id, value })
        if *token_id == id && if inf { *value == f32::INFINITY } else { value.is_nan() })
}

#[test]
fn all_nan_row_beside_healthy_row_fails_alone() {
    let healthy = [0.5f32, 2.0, -1.0, 0.0];
    let p = params(0.9, 0, 1.0, 42);
    for nan_first in [true, false] {
        let mut data = Vec::new();
        if nan_first {
            data.extend([f32::NAN; 4]);
            data.extend(healthy);
        } else {
            data.extend(healthy);
            data.extend([f32::NAN; 4]);
        }
        let view = LogitsView::dense(&data, 2, 4).unwrap();
        let reqs = [
            SampleRequest::new(&p, &[], &[], 9),
            SampleRequest::new(&p, &[], &[], 9),
        ];
        let res = sample_batch(&view, &reqs).expect("shape is fine");
        let (bad, good) = if nan_first { (0, 1) } else { (1, 0) };
        assert!(is_non_finite(&res[bad], 0, false), "{:?}", res[bad]);
        let alone = sample(&healthy, &p, 9);
        assert_eq!(res[good].as_ref().expect("healthy row"), &alone);
    }
    let req = SampleRequest::new(&p, &[], &[], 0);
    assert!(is_non_finite(&sample_row(&[f32::NAN; 4], &req), 0, false));
    assert!(matches!(
        distribution(&[f32::NAN; 4], &req),
        Err(SampleError::NonFiniteLogits { token_id: 0, .. })
    ));
}

#[test]
fn positive_infinity_or_one_nan_fails_that_row_at_the_lowest_id() {
    let p = params(1.0, 0, 1.0, 1);
    let g = SamplingParams::greedy();
    let req = SampleRequest::new(&p, &[], &[], 0);
    let greq = SampleRequest::new(&g, &[], &[], 0);
    for r in [&req, &greq] {
        assert!(is_non_finite(
            &sample_row(&[1.0, f32::INFINITY, 2.0], r),
            1,
            true
        ));
        assert!(is_non_finite(&sample_row(&[f32::INFINITY; 3], r), 0, true));
        assert!(is_non_finite(
            &sample_row(&[1.0, 2.0, f32::NAN], r),
            2,
            false
        ));
        assert!(is_non_finite(
            &sample_row(&[1.0, f32::NAN, f32::INFINITY], r),
            1,
            false
        ));
        assert!(is_non_finite(
            &sample_row(&[f32::NEG_INFINITY, f32::INFINITY], r),
            1,
            true
        ));
    }
    // +inf row beside a healthy row.
    let data = [1.0f32, 2.0, f32::INFINITY, 0.0];
    let view = LogitsView::dense(&data, 2, 2).unwrap();
    let res = sample_batch(&view, &[req, req]).unwrap();
    assert_eq!(res[0].as_ref().unwrap(), &sample(&[1.0, 2.0], &p, 0));
    assert!(is_non_finite(&res[1], 0, true));
}

#[test]
fn all_negative_infinity_row_has_no_candidates() {
    let row = [f32::NEG_INFINITY; 5];
    for p in [
        params(1.0, 0, 1.0, 1),
        SamplingParams::greedy(),
        params(0.5, 2, 0.5, 1),
    ] {
        let req = SampleRequest::new(&p, &[], &[], 0);
        assert_eq!(sample_row(&row, &req), Err(SampleError::NoCandidates));
        assert_eq!(distribution(&row, &req), Err(SampleError::NoCandidates));
        let mut data = vec![0.0f32, 1.0, 2.0, 3.0, 4.0];
        data.extend(row);
        let view = LogitsView::dense(&data, 2, 5).unwrap();
        let res = sample_batch(&view, &[req, req]).unwrap();
        assert!(res[0].is_ok());
        assert_eq!(res[1], Err(SampleError::NoCandidates));
    }
    // The repetition penalty keeps -inf at -inf.
    let p = SamplingParams {
        repetition_penalty: 0.5,
        ..Default::default()
    };
    let req = SampleRequest::new(&p, &[0, 1], &[], 0);
    assert_eq!(sample_row(&row, &req), Err(SampleError::NoCandidates));
}

fn invalid_params() -> Vec<(SamplingParams, &'static str)> {
    let d = SamplingParams {
        seed: Some(1),
        ..Default::default()
    };
    let with = |f: &dyn Fn(&mut SamplingParams)| {
        let mut p = d.clone();
        f(&mut p);
        p
    };
    vec![
        (with(&|p| p.temperature = -1.0), "temperature"),
        (with(&|p| p.temperature = f64::NAN), "temperature"),
        (with(&|p| p.temperature = -1e-9), "temperature"),
        (with(&|p| p.top_k = -2), "top_k"),
        (with(&|p| p.top_k = i64::MIN), "top_k"),
        (with(&|p| p.top_p = 0.0), "top_p"),
        (with(&|p| p.top_p = 1.5), "top_p"),
        (with(&|p| p.top_p = 1.0 + f64::EPSILON), "top_p"),
        (with(&|p| p.top_p = -0.5), "top_p"),
        (with(&|p| p.top_p = f64::NAN), "top_p"),
        (with(&|p| p.repetition_penalty = 0.0), "repetition_penalty"),
        (with(&|p| p.repetition_penalty = -1.0), "repetition_penalty"),
        (
            with(&|p| p.repetition_penalty = f64::NAN),
            "repetition_penalty",
        ),
    ]
}

#[track_caller]
fn assert_param_error<T: std::fmt::Debug>(r: Result<T, SampleError>, field: &str) {
    match r {
        Err(SampleError::InvalidParams(ParamError {
            field: f,
            value,
            allowed,
        })) => {
            assert_eq!(f, field);
            assert!(!value.is_empty() && !allowed.is_empty());
        }
        other => panic!("expected InvalidParams naming `{field}`, got {other:?}"),
    }
}

#[test]
fn out_of_range_params_are_an_error_naming_the_field() {
    let row = [0.0f32, 1.0, 2.0];
    let healthy = params(1.0, 0, 1.0, 3);
    for (p, field) in invalid_params() {
        assert_eq!(p.validate().map_err(|e| e.field), Err(field), "{p:?}");
        let req = SampleRequest::new(&p, &[], &[], 0);
        assert_param_error(sample_row(&row, &req), field);
        assert_param_error(distribution(&row, &req), field);
        // In a batch: that row only.
        let data = [row, row].concat();
        let view = LogitsView::dense(&data, 2, 3).unwrap();
        let res = sample_batch(&view, &[SampleRequest::new(&healthy, &[], &[], 0), req]).unwrap();
        assert_eq!(res[0].as_ref().unwrap(), &sample(&row, &healthy, 0));
        assert_param_error(res[1].clone(), field);
    }
}

#[test]
fn edge_values_in_range_are_accepted() {
    let row = [0.0f32, 1.0, 2.0];
    let d = SamplingParams {
        seed: Some(1),
        ..Default::default()
    };
    for p in [
        SamplingParams {
            temperature: 0.0,
            ..d.clone()
        },
        SamplingParams {
            top_k: -1,
            ..d.clone()
        },
        SamplingParams {
            top_k: 0,
            ..d.clone()
        },
        SamplingParams {
            top_p: 1.0,
            ..d.clone()
        },
        SamplingParams {
            top_p: 1e-300,
            ..d.clone()
        },
        SamplingParams {
            repetition_penalty: 1e-3,
            ..d.clone()
        },
        SamplingParams {
            repetition_penalty: 1e3,
            ..d.clone()
        },
    ] {
        assert_eq!(p.validate(), Ok(()));
        let req = SampleRequest::new(&p, &[0], &[1], 2);
        let o = oracle(&row, &p, &[0], &[1]).expect("oracle");
        let got = distribution(&row, &req).unwrap_or_else(|e| panic!("{p:?}: {e}"));
        assert_close(&got, &o.probs, 1e-6, &format!("{p:?}"));
        assert!(sample_row(&row, &req).is_ok());
    }
}

#[test]
fn context_ids_at_or_above_vocab_size_are_an_error() {
    let row = [0.0f32, 1.0, 2.0];
    let p = params(1.0, 0, 1.0, 1);
    let cases: [(&[u32], &[u32], &'static str, u32); 4] = [
        (&[3], &[], "prompt_ids", 3),
        (&[0, 1, 2, 99], &[], "prompt_ids", 99),
        (&[0], &[1, 7], "output_ids", 7),
        (&[], &[u32::MAX], "output_ids", u32::MAX),
    ];
    for (prompt, output, field, token_id) in cases {
        let want = SampleError::TokenIdOutOfRange {
            field,
            token_id,
            vocab_size: 3,
        };
        let req = SampleRequest::new(&p, prompt, output, 0);
        assert_eq!(sample_row(&row, &req), Err(want.clone()));
        assert_eq!(distribution(&row, &req), Err(want));
        assert_eq!(
            oracle(&row, &p, prompt, output).map(|_| ()),
            Err(OracleError::TokenIdOutOfRange { field, token_id })
        );
    }
    // In a padded view, an id in the padding (>= vocab_size, < row_len) is out of range too.
    let data = [0.0f32, 1.0, 2.0, 9.0, 9.0, 0.0, 1.0, 2.0, 9.0, 9.0];
    let view = LogitsView::new(&data, 2, 5, 5, 3).unwrap();
    let ok = SampleRequest::new(&p, &[2], &[], 0);
    let bad = SampleRequest::new(&p, &[3], &[], 0);
    let res = sample_batch(&view, &[ok, bad]).unwrap();
    assert!(res[0].is_ok());
    assert_eq!(
        res[1],
        Err(SampleError::TokenIdOutOfRange {
            field: "prompt_ids",
            token_id: 3,
            vocab_size: 3
        })
    );
}

// ---------------------------------------------------------------------------------------------
// Padding, shapes.

#[test]
fn padded_rows_never_choose_padding_and_nan_there_is_fine() {
    let vocab = 5;
    let (row_len, stride, batch) = (8, 11, 3);
    let mut data = vec![f32::NAN; (batch - 1) * stride + row_len];
    let rows: [[f32; 5]; 3] = [
        [0.1, 2.0, -1.0, 1.9, 0.0],
        [3.0, 3.0, 1.0, f32::NEG_INFINITY, -2.0],
        [-1.0, -0.5, -0.25, -0.125, -4.0],
    ];
    for (b, row) in rows.iter().enumerate() {
        let s = b * stride;
        data[s..s + vocab].copy_from_slice(row);
        // Padding ids 5..8: huge, +inf, NaN. The gap 8..11 stays NaN.
        data[s + 5] = 1e30;
        data[s + 6] = f32::INFINITY;
        data[s + 7] = f32::NAN;
    }
    let view = LogitsView::new(&data, batch, row_len, stride, vocab).unwrap();
    assert_eq!(view.row(1), &rows[1]);
    // Seeded, so the reported seed is comparable between calls (an OS seed is not).
    let g = SamplingParams {
        seed: Some(4),
        ..SamplingParams::greedy()
    };
    let t1 = params(1.0, 0, 1.0, 5);
    let mixed = params(0.7, 3, 0.9, 6);
    for position in 0..200 {
        for ps in [[&g, &t1, &mixed], [&t1, &mixed, &g], [&mixed, &g, &t1]] {
            let reqs: Vec<SampleRequest> = ps
                .iter()
                .map(|p| SampleRequest::new(p, &[], &[], position))
                .collect();
            let res = sample_batch(&view, &reqs).expect("shape is fine");
            for b in 0..batch {
                let out = res[b].as_ref().expect("padding is not an error");
                assert!(
                    (out.token as usize) < vocab,
                    "padding id {} chosen",
                    out.token
                );
                assert_eq!(out, &sample_row(&rows[b], &reqs[b]).unwrap(), "row {b}");
            }
        }
    }
    let res = sample_batch(&view, &[SampleRequest::new(&g, &[], &[], 0); 3]).unwrap();
    let tokens: Vec<u32> = res.iter().map(|r| r.as_ref().unwrap().token).collect();
    assert_eq!(tokens, [1, 0, 3]);
}

#[test]
fn bad_views_and_request_count_mismatch_are_shape_errors() {
    let data = [0.0f32; 12];
    assert_eq!(
        LogitsView::new(&data, 2, 6, 5, 5).unwrap_err(),
        ShapeError::RowLongerThanStride {
            row_len: 6,
            row_stride: 5
        }
    );
    assert_eq!(
        LogitsView::new(&data, 2, 6, 6, 0).unwrap_err(),
        ShapeError::BadVocabSize {
            vocab_size: 0,
            row_len: 6
        }
    );
    assert_eq!(
        LogitsView::new(&data, 2, 6, 6, 7).unwrap_err(),
        ShapeError::BadVocabSize {
            vocab_size: 7,
            row_len: 6
        }
    );
    assert_eq!(
        LogitsView::new(&data, 3, 5, 6, 5).unwrap_err(),
        ShapeError::DataTooShort {
            len: 12,
            batch: 3,
            row_stride: 6,
            row_len: 5,
            needed: 17
        }
    );
    assert_eq!(
        LogitsView::dense(&data, 2, 7).unwrap_err(),
        ShapeError::DataTooShort {
            len: 12,
            batch: 2,
            row_stride: 7,
            row_len: 7,
            needed: 14
        }
    );
    // batch (2 - 1) * 5 + 5 = 10 <= 12: fine, with and without padding.
    assert!(LogitsView::new(&data, 2, 5, 5, 5).is_ok());
    assert!(LogitsView::new(&data, 2, 5, 7, 3).is_ok());
    #[cfg(target_pointer_width = "64")]
    {
        let big = 1usize << 33;
        assert_eq!(
            LogitsView::<f32>::new(&[], 0, big, big, 1 << 32).unwrap_err(),
            ShapeError::VocabTooLarge {
                vocab_size: 1 << 32
            }
        );
    }

    let view = LogitsView::dense(&data, 3, 4).unwrap();
    let p = params(1.0, 0, 1.0, 1);
    let r = SampleRequest::new(&p, &[], &[], 0);
    assert_eq!(
        sample_batch(&view, &[r, r]).unwrap_err(),
        ShapeError::RequestCountMismatch {
            requests: 2,
            batch: 3
        }
    );
    assert_eq!(
        sample_batch(&view, &[r; 4]).unwrap_err(),
        ShapeError::RequestCountMismatch {
            requests: 4,
            batch: 3
        }
    );
    assert_eq!(
        sample_batch(&view, &[]).unwrap_err(),
        ShapeError::RequestCountMismatch {
            requests: 0,
            batch: 3
        }
    );
    let empty = LogitsView::<f32>::dense(&[], 0, 4).unwrap();
    assert_eq!(sample_batch(&empty, &[]).unwrap(), vec![]);
}

// ---------------------------------------------------------------------------------------------
// Seeds, selection, outputs.

#[test]
fn seed_42_gives_the_same_tokens_alone_first_and_last_in_a_batch_of_16() {
    let vocab = 97;
    let target = SamplingParams {
        temperature: 0.9,
        top_k: 40,
        top_p: 0.95,
        repetition_penalty: 1.1,
        seed: Some(42),
        ..Default::default()
    };
    let others: Vec<SamplingParams> = (0..15)
        .map(|i| SamplingParams {
            temperature: [0.0, 0.5, 1.0, 1.7][i % 4],
            top_k: [0, 5, 50, -1, 1][i % 5],
            top_p: [1.0, 0.9, 0.5][i % 3],
            repetition_penalty: [1.0, 1.3][i % 2],
            seed: if i % 3 == 0 { None } else { Some(i as u64) },
            ..Default::default()
        })
        .collect();
    let prompt: Vec<u32> = (0..12).map(|i| (i * 7 % vocab) as u32).collect();
    let mut generated: [Vec<u32>; 3] = Default::default();
    for step in 0..16u64 {
        let position = prompt.len() as u64 + step;
        let target_row = normal_row(1000 + step, vocab, 2.0);
        let filler: Vec<Vec<f32>> = (0..15)
            .map(|i| normal_row(step * 100 + i, vocab, 3.0))
            .collect();
        let mut outs = Vec::new();
        for (placement, out_ids) in generated.iter_mut().enumerate() {
            let req = SampleRequest::new(&target, &prompt, out_ids, position);
            let other_reqs: Vec<SampleRequest> = others
                .iter()
                .map(|p| SampleRequest::new(p, &prompt, &[], position))
                .collect();
            let (rows, reqs): (Vec<&[f32]>, Vec<SampleRequest>) = match placement {
                0 => (vec![&target_row[..]], vec![req]),
                1 => (
                    std::iter::once(&target_row[..])
                        .chain(filler.iter().map(|r| &r[..]))
                        .collect(),
                    std::iter::once(req).chain(other_reqs).collect(),
                ),
                _ => (
                    filler
                        .iter()
                        .map(|r| &r[..])
                        .chain(std::iter::once(&target_row[..]))
                        .collect(),
                    other_reqs.into_iter().chain(std::iter::once(req)).collect(),
                ),
            };
            let data = rows.concat();
            let view = LogitsView::dense(&data, rows.len(), vocab).unwrap();
            let res = sample_batch(&view, &reqs).unwrap();
            let idx = if placement == 2 { 15 } else { 0 };
            let out = res[idx].clone().expect("target row");
            outs.push(out.clone());
            out_ids.push(out.token);
        }
        assert_eq!(outs[0], outs[1], "step {step}: alone vs first of 16");
        assert_eq!(outs[0], outs[2], "step {step}: alone vs last of 16");
        assert_eq!(outs[0].logprob.to_bits(), outs[2].logprob.to_bits());
        // And the token is the one the spec selects.
        let o = oracle(
            &target_row,
            &target,
            &prompt,
            &generated[0][..step as usize],
        )
        .unwrap();
        assert!(o.probs[outs[0].token as usize] > 0.0);
        // Fixed rows: they must be clear of rounding boundaries, so this always checks.
        assert!(!o.fragile, "step {step}: row on a rounding boundary");
        let want =
            inverse_cdf(&o.probs, spec_uniform(42, position, 0), 1e-5).expect("u on a boundary");
        assert_eq!(outs[0].token, want, "step {step}");
    }
    assert_eq!(generated[0], generated[1]);
    assert_eq!(generated[0], generated[2]);
}

#[test]
fn reported_seed_reproduces_the_draw() {
    let row = vec![0.0f32; 1000]; // uniform over 1000 tokens: a wrong seed shows
    let given = params(1.0, 0, 1.0, 0xABCD_EF01_2345_6789);
    assert_eq!(sample(&row, &given, 3).seed, 0xABCD_EF01_2345_6789);

    let unseeded = SamplingParams::default();
    let a = sample(&row, &unseeded, 3);
    let b = sample(&row, &unseeded, 3);
    assert_ne!(a.seed, b.seed, "two OS seeds collided (probability 2^-64)");
    for out in [a, b] {
        let reseeded = params(1.0, 0, 1.0, out.seed);
        assert_eq!(sample(&row, &reseeded, 3), out);
        // Token from the spec: u from the reported seed, inverse CDF over 1000 x 0.001.
        let u = spec_uniform(out.seed, 3, 0);
        if let Some(want) = inverse_cdf(&[1e-3; 1000], u, 1e-6) {
            assert_eq!(out.token, want);
        }
    }
    // Through a batch too.
    let data = [row.clone(), row.clone()].concat();
    let view = LogitsView::dense(&data, 2, 1000).unwrap();
    let reqs = [SampleRequest::new(&unseeded, &[], &[], 3); 2];
    let res = sample_batch(&view, &reqs).unwrap();
    for r in res {
        let out = r.unwrap();
        assert_eq!(sample(&row, &params(1.0, 0, 1.0, out.seed), 3), out);
    }
}

#[test]
fn selection_is_the_inverse_cdf_in_token_id_order() {
    // Probabilities not in id order, so walking by probability would pick other tokens.
    let cases: [&[f64]; 4] = [
        &[0.25, 0.25, 0.25, 0.25],
        &[0.1, 0.2, 0.3, 0.4],
        &[0.4, 0.1, 0.3, 0.2],
        &[0.05, 0.6, 0.01, 0.3, 0.04],
    ];
    for probs in cases {
        let row = ln_row(probs);
        for seed in [1u64, 42, u64::MAX] {
            let p = params(1.0, 0, 1.0, seed);
            let mut checked = 0;
            for position in 0..1000 {
                let out = sample(&row, &p, position);
                if let Some(want) = inverse_cdf(probs, spec_uniform(seed, position, 0), 1e-5) {
                    assert_eq!(out.token, want, "{probs:?} seed {seed} position {position}");
                    checked += 1;
                }
            }
            assert!(checked > 900);
        }
    }
}

#[test]
fn logprob_and_num_candidates_match_the_distribution() {
    let mut g = SplitMix(2024);
    for trial in 0..300u64 {
        let n = 1 + g.below(60) as usize;
        let row: Vec<f32> = (0..n)
            .map(|_| {
                if g.below(8) == 0 {
                    f32::NEG_INFINITY
                } else {
                    (g.normal() * 2.0) as f32
                }
            })
            .collect();
        if row.iter().all(|x| *x == f32::NEG_INFINITY) {
            continue;
        }
        let p = SamplingParams {
            temperature: [0.0, 0.2, 1.0, 4.0][trial as usize % 4],
            top_k: g.below(n as u64 + 2) as i64 - 1,
            top_p: [1.0, 0.9, 0.3][trial as usize % 3],
            repetition_penalty: 1.0,
            seed: Some(trial),
            ..Default::default()
        };
        let req = SampleRequest::new(&p, &[], &[], trial);
        let d = distribution(&row, &req).unwrap();
        let out = sample_row(&row, &req).unwrap();
        let nonzero = d.iter().filter(|&&x| x > 0.0).count();
        assert_eq!(out.num_candidates, nonzero, "{row:?} {p:?}");
        assert!(d[out.token as usize] > 0.0);
        if p.is_greedy() {
            assert_eq!(out.logprob, 0.0);
            assert_eq!(nonzero, 1);
        } else {
            assert!((out.logprob - d[out.token as usize].ln()).abs() <= 1e-6);
        }
        let o = oracle(&row, &p, &[], &[]).unwrap();
        if !o.fragile {
            assert_close(&d, &o.probs, 1e-6, &format!("{row:?} {p:?}"));
        }
    }
}
