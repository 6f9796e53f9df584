//! Speculative verification (`nucleus_sampling::speculative`) against its definition
//! (Leviathan et al. 2023; Chen et al. 2023; spec/sampling.md "Random streams": counter word 3
//! = 2 for the acceptance test, 3 for the residual or bonus sample).
//!
//! Oracles, all independent of the code under test: the f64 softmax of the target rows; the
//! spec's uniform computed from the Philox words (`common::spec_uniform_kind`); inverse-CDF
//! selection written here; the closed form of the expected number of accepted tokens.
//! Statistical tests use fixed seeds and alpha 1e-6 each (a correct implementation fails about
//! once in a million runs).

mod common;

use common::stats::chi_square_test;
use common::SplitMix;
use nucleus_sampling::speculative::{verify, verify_batch, TargetRows, VerifyRequest};
use nucleus_sampling::{SampleError, SamplingParams};

const ALPHA: f64 = 1e-6;

/// The spec's uniform at `(seed, position, 0)` with draw kind `kind` (counter word 3), from the
/// Philox words: `x = (w0 << 32 | w1) >> 11`, `u = (x + 0.5) / 2^53`.
fn spec_uniform_kind(seed: u64, position: u64, kind: u32) -> f64 {
    let w = nucleus_sampling::philox::philox4x32_10(
        [position as u32, (position >> 32) as u32, 0, kind],
        [seed as u32, (seed >> 32) as u32],
    );
    common::uniform_from_words(w)
}

fn softmax(row: &[f32]) -> Vec<f64> {
    let max = row
        .iter()
        .fold(f64::NEG_INFINITY, |m, &l| m.max(f64::from(l)));
    let e: Vec<f64> = row.iter().map(|&l| (f64::from(l) - max).exp()).collect();
    let z: f64 = e.iter().sum();
    e.iter().map(|x| x / z).collect()
}

/// Inverse CDF in id order; `None` when `u * total` lies within 1e-9 of a boundary (either
/// answer may then be right).
fn inverse_cdf(w: &[f64], u: f64) -> Option<u32> {
    let total: f64 = w.iter().sum();
    let target = u * total;
    let mut acc = 0.0;
    for (i, &x) in w.iter().enumerate() {
        let next = acc + x;
        if (next - target).abs() < 1e-9 * total {
            return None;
        }
        if next > target {
            return Some(i as u32);
        }
        acc = next;
    }
    None
}

fn params(seed: u64) -> SamplingParams {
    SamplingParams {
        seed: Some(seed),
        ..Default::default()
    }
}

/// Three target rows and two draft rows over 4 ids (rows independent of the prefix: no
/// penalties).
fn case() -> (Vec<f32>, Vec<f32>) {
    let target = vec![
        1.0, 0.0, -0.5, 0.5, // row 0
        -1.0, 0.3, 0.9, 0.0, // row 1
        0.2, 0.2, -2.0, 1.0, // row 2 (bonus)
    ];
    let draft = vec![
        0.1, 0.5, 0.3, 0.1, // row 0
        0.25, 0.25, 0.25, 0.25, // row 1
    ];
    (target, draft)
}

#[test]
fn every_step_matches_the_rule_worked_from_the_uniforms() {
    let (target, draft) = case();
    let p: Vec<Vec<f64>> = target.chunks(4).map(softmax).collect();
    let q: Vec<Vec<f64>> = draft
        .chunks(4)
        .map(|r| r.iter().map(|&x| f64::from(x)).collect())
        .collect();
    let mut g = SplitMix(17);
    let mut checked = 0;
    for trial in 0..400u64 {
        let seed = 1_000 + trial;
        let ids = [g.below(4) as u32, g.below(4) as u32];
        let par = params(seed);
        let req = VerifyRequest {
            params: &par,
            prompt_ids: &[],
            output_ids: &[],
            position: 7,
            draft_token_ids: &ids,
            draft_probs: Some(&draft),
            target: TargetRows::Logits(&target),
            vocab_size: 4,
        };
        let got = verify(&req).unwrap();
        assert_eq!(got.seed, seed);
        // The oracle: walk the positions with the spec's uniforms.
        let mut want = Vec::new();
        let mut decided = true;
        for i in 0..=2usize {
            let pos = 7 + i as u64;
            let r = spec_uniform_kind(seed, pos, 3);
            if i == 2 {
                match inverse_cdf(&p[2], r) {
                    Some(t) => want.push(t),
                    None => decided = false,
                }
                break;
            }
            let x = ids[i] as usize;
            let ratio = p[i][x] / q[i][x];
            let u = spec_uniform_kind(seed, pos, 2);
            if (ratio - u).abs() < 1e-9 {
                decided = false;
                break;
            }
            if ratio >= u {
                want.push(x as u32);
                continue;
            }
            let residual: Vec<f64> = p[i]
                .iter()
                .zip(&q[i])
                .map(|(a, b)| (a - b).max(0.0))
                .collect();
            match inverse_cdf(&residual, r) {
                Some(t) => want.push(t),
                None => decided = false,
            }
            break;
        }
        if !decided {
            continue;
        }
        checked += 1;
        assert_eq!(got.tokens, want, "seed {seed} draft {ids:?}");
        assert_eq!(got.accepted, want.len() - 1);
        for (j, (&t, &lp)) in got.tokens.iter().zip(&got.logprobs).enumerate() {
            assert!(
                (lp - p[j][t as usize].ln()).abs() < 1e-6,
                "seed {seed} position {j}"
            );
        }
    }
    assert!(checked > 390, "only {checked} trials away from boundaries");
}

#[test]
fn each_position_is_distributed_as_the_target_and_the_mean_accepted_is_the_closed_form() {
    // Draft tokens drawn from the draft rows with an independent stream per trial.
    let (target, draft) = case();
    let p: Vec<Vec<f64>> = target.chunks(4).map(softmax).collect();
    let q: Vec<Vec<f64>> = draft
        .chunks(4)
        .map(|r| r.iter().map(|&x| f64::from(x)).collect())
        .collect();
    let trials = 40_000u64;
    let mut first = vec![0u64; 4];
    let mut second = vec![0u64; 4];
    let mut accepted_total = 0usize;
    let mut g = SplitMix(99);
    for trial in 0..trials {
        let ids: Vec<u32> = (0..2)
            .map(|i| {
                let u = g.next_f64();
                inverse_cdf(&q[i], u).unwrap_or(3)
            })
            .collect();
        let par = params(trial * 7 + 5);
        let got = verify(&VerifyRequest {
            params: &par,
            prompt_ids: &[],
            output_ids: &[],
            position: 0,
            draft_token_ids: &ids,
            draft_probs: Some(&draft),
            target: TargetRows::Logits(&target),
            vocab_size: 4,
        })
        .unwrap();
        first[got.tokens[0] as usize] += 1;
        if got.tokens.len() > 1 {
            // Position 1 is reached only after an acceptance; its rows do not depend on the
            // prefix, so its token is distributed as p_1.
            second[got.tokens[1] as usize] += 1;
        }
        accepted_total += got.accepted;
    }
    let cs = chi_square_test(&first, &p[0], ALPHA);
    assert_eq!(cs.outside_support, 0);
    assert!(cs.statistic < cs.critical, "position 0: {cs:?}");
    let cs = chi_square_test(&second, &p[1], ALPHA);
    assert_eq!(cs.outside_support, 0);
    assert!(cs.statistic < cs.critical, "position 1: {cs:?}");
    // E[accepted] = sum_i prod_{j <= i} alpha_j, alpha_j = sum_x min(p_j(x), q_j(x)).
    let alpha: Vec<f64> = (0..2)
        .map(|j| p[j].iter().zip(&q[j]).map(|(a, b)| a.min(*b)).sum())
        .collect();
    let want = alpha[0] + alpha[0] * alpha[1];
    let mean = accepted_total as f64 / trials as f64;
    // accepted is in [0, 2]: its standard deviation is at most 1; 5 sigma of the mean
    // (false failure below 1e-6).
    let bound = 5.0 / (trials as f64).sqrt();
    assert!(
        (mean - want).abs() < bound,
        "mean {mean} vs {want} (bound {bound})"
    );
}

#[test]
fn identical_distributions_accept_every_draft_token() {
    let probs = [
        0.1f32, 0.2, 0.3, 0.4, 0.25, 0.25, 0.25, 0.25, 0.7, 0.1, 0.1, 0.1,
    ];
    for seed in 0..200 {
        let par = params(seed);
        let got = verify(&VerifyRequest {
            params: &par,
            prompt_ids: &[],
            output_ids: &[],
            position: 3,
            draft_token_ids: &[2, 1],
            draft_probs: Some(&probs[..8]),
            target: TargetRows::Probs(&probs),
            vocab_size: 4,
        })
        .unwrap();
        assert_eq!(got.accepted, 2, "seed {seed}");
        assert_eq!(&got.tokens[..2], &[2, 1]);
    }
}

#[test]
fn greedy_accepts_while_the_draft_is_the_argmax() {
    let (target, draft) = case();
    // Argmaxes: row 0 id 0, row 1 id 2, row 2 id 3.
    let par = SamplingParams {
        temperature: 0.0,
        seed: Some(1),
        ..Default::default()
    };
    for (ids, want) in [
        (vec![0u32, 2], vec![0u32, 2, 3]),
        (vec![0, 1], vec![0, 2]),
        (vec![3, 2], vec![0]),
    ] {
        for probs in [Some(&draft[..]), None] {
            let got = verify(&VerifyRequest {
                params: &par,
                prompt_ids: &[],
                output_ids: &[],
                position: 0,
                draft_token_ids: &ids,
                draft_probs: probs,
                target: TargetRows::Logits(&target),
                vocab_size: 4,
            })
            .unwrap();
            assert_eq!(got.tokens, want, "{ids:?} one-hot {}", probs.is_none());
        }
    }
}

#[test]
fn a_one_hot_draft_accepts_with_the_target_probability() {
    // No draft distribution: x_0 = 1 is accepted with probability p_0(1); on rejection the
    // token is drawn from p_0 without id 1.
    let (target, _) = case();
    let p0 = softmax(&target[..4]);
    let trials = 40_000u64;
    let (mut accepted, mut rejected_to) = (0u64, vec![0u64; 4]);
    for seed in 0..trials {
        let par = params(seed);
        let got = verify(&VerifyRequest {
            params: &par,
            prompt_ids: &[],
            output_ids: &[],
            position: 11,
            draft_token_ids: &[1],
            draft_probs: None,
            target: TargetRows::Logits(&target[..8]),
            vocab_size: 4,
        })
        .unwrap();
        if got.accepted == 1 {
            accepted += 1;
        } else {
            rejected_to[got.tokens[0] as usize] += 1;
        }
    }
    let rate = accepted as f64 / trials as f64;
    // Binomial: 5 sigma.
    let sigma = (p0[1] * (1.0 - p0[1]) / trials as f64).sqrt();
    assert!(
        (rate - p0[1]).abs() < 5.0 * sigma,
        "rate {rate} vs {}",
        p0[1]
    );
    let mut want = p0.clone();
    want[1] = 0.0;
    let z: f64 = want.iter().sum();
    want.iter_mut().for_each(|x| *x /= z);
    let cs = chi_square_test(&rejected_to, &want, ALPHA);
    assert_eq!(cs.outside_support, 0, "the rejected token came back");
    assert!(cs.statistic < cs.critical, "{cs:?}");
}

#[test]
fn penalties_see_the_drafted_tokens() {
    // Repetition penalty 1e9 on every seen id: row 1 is processed in the context
    // output + [draft 0], so the drafted id 0 is all but banned there, and greedy picks
    // row 1's best other id.
    let target = [5.0f32, 1.0, 0.0, 4.0, 5.0, 1.0, 0.0, 4.0];
    let par = SamplingParams {
        temperature: 0.0,
        repetition_penalty: 1e9,
        seed: Some(3),
        ..Default::default()
    };
    let got = verify(&VerifyRequest {
        params: &par,
        prompt_ids: &[],
        output_ids: &[],
        position: 0,
        draft_token_ids: &[0],
        draft_probs: None,
        target: TargetRows::Logits(&target),
        vocab_size: 4,
    })
    .unwrap();
    // Row 0 argmax 0 (accepted); row 1 with 0 seen: 5 / 1e9 < 4, argmax 3.
    assert_eq!(got.tokens, vec![0, 3]);
}

#[test]
fn bad_input_is_a_typed_error() {
    let (target, draft) = case();
    let par = params(1);
    let base = VerifyRequest {
        params: &par,
        prompt_ids: &[],
        output_ids: &[],
        position: 0,
        draft_token_ids: &[1, 2],
        draft_probs: Some(&draft),
        target: TargetRows::Logits(&target),
        vocab_size: 4,
    };
    let field = |r: VerifyRequest<'_>| match verify(&r) {
        Err(SampleError::InvalidParams(e)) => e.field,
        Err(SampleError::TokenIdOutOfRange { field, .. }) => field,
        other => panic!("{other:?}"),
    };
    // A drafted token of draft probability 0.
    let mut zero = draft.clone();
    zero[1] = 0.0;
    assert_eq!(
        field(VerifyRequest {
            draft_probs: Some(&zero),
            ..base
        }),
        "draft_probs"
    );
    let mut neg = draft.clone();
    neg[6] = -0.1;
    assert_eq!(
        field(VerifyRequest {
            draft_probs: Some(&neg),
            ..base
        }),
        "draft_probs"
    );
    let mut nan = draft.clone();
    nan[0] = f32::NAN;
    assert_eq!(
        field(VerifyRequest {
            draft_probs: Some(&nan),
            ..base
        }),
        "draft_probs"
    );
    assert_eq!(
        field(VerifyRequest {
            draft_probs: Some(&draft[..7]),
            ..base
        }),
        "draft_probs"
    );
    assert_eq!(
        field(VerifyRequest {
            target: TargetRows::Logits(&target[..8]),
            ..base
        }),
        "target"
    );
    assert_eq!(
        field(VerifyRequest {
            draft_token_ids: &[1, 4],
            ..base
        }),
        "draft_token_ids"
    );
    assert_eq!(
        field(VerifyRequest {
            vocab_size: 0,
            ..base
        }),
        "vocab_size"
    );
    let miro = SamplingParams {
        mirostat: 2,
        seed: Some(1),
        ..Default::default()
    };
    assert_eq!(
        field(VerifyRequest {
            params: &miro,
            ..base
        }),
        "mirostat"
    );
    // A NaN target logit: the row's own error.
    let mut bad = target.clone();
    bad[5] = f32::NAN;
    assert!(matches!(
        verify(&VerifyRequest {
            target: TargetRows::Logits(&bad),
            ..base
        }),
        Err(SampleError::NonFiniteLogits { .. })
    ));
}

#[test]
fn a_batch_gives_each_request_its_answer_alone_on_one_or_two_threads() {
    // 16 requests over a 3,000-id vocabulary (rows long enough for the sampler's chunked
    // sums), different drafts, seeds, positions and parameters; one request is invalid.
    let v = 3_000usize;
    let mut g = SplitMix(4242);
    let k = 3usize;
    let targets: Vec<Vec<f32>> = (0..16)
        .map(|_| {
            (0..(k + 1) * v)
                .map(|_| (g.next_f64() * 8.0 - 4.0) as f32)
                .collect()
        })
        .collect();
    let drafts: Vec<Vec<f32>> = (0..16)
        .map(|_| (0..k * v).map(|_| g.next_f64() as f32 + 1e-3).collect())
        .collect();
    let ids: Vec<Vec<u32>> = (0..16)
        .map(|r| {
            (0..k)
                .map(|_| {
                    if r == 5 {
                        3_000
                    } else {
                        g.below(v as u64) as u32
                    }
                })
                .collect()
        })
        .collect();
    let pars: Vec<SamplingParams> = (0..16)
        .map(|r| SamplingParams {
            seed: Some(900 + r as u64),
            temperature: [1.0, 0.7, 0.0, 1.3][r % 4],
            top_p: [1.0, 0.9][r % 2],
            repetition_penalty: [1.0, 1.2, 1.0, 1.1][r % 4],
            ..Default::default()
        })
        .collect();
    let output = [1u32, 2, 3];
    let reqs: Vec<VerifyRequest<'_>> = (0..16)
        .map(|r| VerifyRequest {
            params: &pars[r],
            prompt_ids: &[7, 8],
            output_ids: &output,
            position: 5 + r as u64,
            draft_token_ids: &ids[r],
            draft_probs: if r % 3 == 0 { None } else { Some(&drafts[r]) },
            target: TargetRows::Logits(&targets[r]),
            vocab_size: v,
        })
        .collect();
    let alone: Vec<_> = reqs.iter().map(verify).collect();
    assert!(alone[5].is_err());
    assert!(alone.iter().enumerate().all(|(r, a)| r == 5 || a.is_ok()));
    for threads in [1, 2] {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build()
            .unwrap();
        let batch = pool.install(|| verify_batch(&reqs));
        assert_eq!(
            format!("{batch:?}"),
            format!("{alone:?}"),
            "{threads} threads"
        );
        // Reversed order: the same answers, reversed.
        let rev: Vec<VerifyRequest<'_>> = reqs.iter().rev().copied().collect();
        let mut back = pool.install(|| verify_batch(&rev));
        back.reverse();
        assert_eq!(
            format!("{back:?}"),
            format!("{alone:?}"),
            "{threads} threads, reversed"
        );
    }
}
