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
use nucleus_sampling::speculative::{
    verify, verify_batch, verify_chain, TargetRows, Verifier, VerifyRequest,
};
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
            verifier: Verifier::Params(&par),
            stop_token_ids: &[],
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
        let Some((want, _)) = walk(seed, 7, &ids, &q, |i, _| p[i].clone()) else {
            continue;
        };
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
            verifier: Verifier::Params(&par),
            stop_token_ids: &[],
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
            verifier: Verifier::Params(&par),
            stop_token_ids: &[],
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
                verifier: Verifier::Params(&par),
                stop_token_ids: &[],
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
            verifier: Verifier::Params(&par),
            stop_token_ids: &[],
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
        verifier: Verifier::Params(&par),
        stop_token_ids: &[],
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
        verifier: Verifier::Params(&par),
        stop_token_ids: &[],
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
            verifier: Verifier::Params(&miro),
            stop_token_ids: &[],
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
            verifier: Verifier::Params(&pars[r]),
            stop_token_ids: &[],
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

/// A chain from its JSON configuration.
fn chain(json: &str) -> nucleus_sampling::SamplerChain {
    let config: Vec<nucleus_sampling::ProcessorConfig> = serde_json::from_str(json).unwrap();
    nucleus_sampling::SamplerChain::from_config(&config).unwrap()
}

/// The oracle's walk over the positions with the spec's uniforms: `p(i, accepted so far)` is
/// the target's distribution of row `i`, `q` the draft rows. `None` when a uniform lies within
/// 1e-9 of a decision boundary.
fn walk(
    seed: u64,
    position: u64,
    ids: &[u32],
    q: &[Vec<f64>],
    mut p: impl FnMut(usize, &[u32]) -> Vec<f64>,
) -> Option<(Vec<u32>, Vec<Vec<f64>>)> {
    let k = ids.len();
    let (mut want, mut rows) = (Vec::new(), Vec::new());
    for i in 0..=k {
        let pos = position + i as u64;
        let pi = p(i, &want);
        rows.push(pi.clone());
        let r = spec_uniform_kind(seed, pos, 3);
        if i == k {
            want.push(inverse_cdf(&pi, r)?);
            break;
        }
        let x = ids[i] as usize;
        let ratio = pi[x] / q[i][x];
        let u = spec_uniform_kind(seed, pos, 2);
        if (ratio - u).abs() < 1e-9 {
            return None;
        }
        if ratio >= u {
            want.push(x as u32);
            continue;
        }
        let residual: Vec<f64> = pi
            .iter()
            .zip(&q[i])
            .map(|(a, b)| (a - b).max(0.0))
            .collect();
        want.push(inverse_cdf(&residual, r)?);
        break;
    }
    Some((want, rows))
}

#[test]
fn a_chain_verifies_with_its_processors_in_the_drafted_context() {
    // Repetition penalty 2 and temperature 0.7 in a chain reset with the prompt and told the
    // output: row i penalises prompt + output + draft[..i]. Oracle: the f64 penalty (HF:
    // positive logits divided, negative multiplied), temperature and softmax, walked with the
    // spec's uniforms.
    let (target, draft) = case();
    let q: Vec<Vec<f64>> = draft
        .chunks(4)
        .map(|r| r.iter().map(|&x| f64::from(x)).collect())
        .collect();
    let (prompt, output) = ([2u32], [3u32]);
    let mut g = SplitMix(29);
    let mut checked = 0;
    for trial in 0..300u64 {
        let seed = 50_000 + trial;
        let ids = [g.below(4) as u32, g.below(4) as u32];
        let mut c = chain(&format!(
            r#"[{{"repetition_penalty": {{"penalty": 2.0}}}}, {{"temperature": {{"t": 0.7}}}},
                {{"sample": {{"seed": {seed}}}}}]"#
        ));
        c.reset(&prompt);
        c.accept(output[0]);
        let before = c.clone();
        let mut req = VerifyRequest::new(Verifier::Chain(&c), &ids, TargetRows::Logits(&target), 4);
        req.prompt_ids = &prompt;
        req.output_ids = &output;
        req.position = 9;
        req.draft_probs = Some(&draft);
        let got = verify(&req).unwrap();
        assert_eq!(got.seed, seed);
        let oracle = walk(seed, 9, &ids, &q, |i, accepted| {
            let mut seen = vec![false; 4];
            for &t in prompt.iter().chain(&output).chain(accepted) {
                seen[t as usize] = true;
            }
            let row: Vec<f32> = target[i * 4..(i + 1) * 4]
                .iter()
                .zip(&seen)
                .map(|(&l, &s)| {
                    let l = f64::from(l);
                    let l = if !s {
                        l
                    } else if l > 0.0 {
                        l / 2.0
                    } else {
                        l * 2.0
                    };
                    (l / 0.7) as f32
                })
                .collect();
            softmax(&row)
        });
        let Some((want, rows)) = oracle else { continue };
        checked += 1;
        assert_eq!(got.tokens, want, "seed {seed} draft {ids:?}");
        for (j, (&t, &lp)) in got.tokens.iter().zip(&got.logprobs).enumerate() {
            assert!(
                (lp - rows[j][t as usize].ln()).abs() < 1e-6,
                "seed {seed} row {j}"
            );
        }
        // The request's chain is not changed; verify_chain advances its own.
        let mut advanced = before.clone();
        let again = verify_chain(&req, &mut advanced).unwrap();
        assert_eq!(again, got);
    }
    assert!(checked > 290, "only {checked} trials away from boundaries");
}

#[test]
fn a_mirostat_chain_moves_mu_with_each_accepted_draft_token() {
    // Mirostat v2 (tau 1.5, eta 2: accepting id 0 at row 0 moves mu from 3 to about 4.6,
    // which lets id 0 into row 1's kept set): row i keeps the tokens of surprise -log2 p <= mu_i and
    // renormalises; mu_{i+1} = mu_i - eta (-log2 q_i(x_i) - tau) with q_i the kept
    // distribution (llama.cpp's llama_sampler_mirostat_v2_apply). Oracle in f64 from
    // mu_0 = 2 tau.
    let target = [
        2.0f32, 1.5, 0.5, -1.0, // row 0
        0.3, 2.2, 1.9, -0.5, // row 1
        1.0, 0.9, 0.8, 0.7, // row 2 (bonus)
    ];
    let (tau, eta) = (1.5f64, 2.0f64);
    let kept = |row: &[f32], mu: f64| -> Vec<f64> {
        let p = softmax(row);
        let mut k: Vec<f64> = p
            .iter()
            .map(|&x| if -x.log2() <= mu { x } else { 0.0 })
            .collect();
        if k.iter().all(|&x| x == 0.0) {
            let best = (0..p.len()).fold(0, |b, i| if p[i] > p[b] { i } else { b });
            k[best] = 1.0;
        }
        let z: f64 = k.iter().sum();
        k.iter().map(|x| x / z).collect()
    };
    let mut checked = 0;
    for seed in 0..300u64 {
        let ids = [(seed % 3) as u32, ((seed / 3) % 3) as u32];
        let mut c = chain(&format!(
            r#"[{{"mirostat_v2": {{"tau": {tau}, "eta": {eta}, "seed": {seed}}}}}]"#
        ));
        c.reset(&[]);
        let req = VerifyRequest::new(Verifier::Chain(&c), &ids, TargetRows::Logits(&target), 4);
        let mut advanced = c.clone();
        let got = verify_chain(&req, &mut advanced).unwrap();
        // One-hot draft: q_i(x_i) = 1.
        let one_hot: Vec<Vec<f64>> = ids
            .iter()
            .map(|&x| (0..4).map(|t| f64::from(u8::from(t == x))).collect())
            .collect();
        let mut mu = 2.0 * tau;
        let oracle = walk(seed, 0, &ids, &one_hot, |i, accepted| {
            // Replay mu over the tokens accepted before row i.
            mu = 2.0 * tau;
            for (j, &t) in accepted.iter().enumerate() {
                let qj = kept(&target[j * 4..(j + 1) * 4], mu);
                mu -= eta * (-qj[t as usize].log2() - tau);
            }
            kept(&target[i * 4..(i + 1) * 4], mu)
        });
        let Some((want, rows)) = oracle else { continue };
        checked += 1;
        assert_eq!(got.tokens, want, "seed {seed} draft {ids:?}");
        for (j, (&t, &lp)) in got.tokens.iter().zip(&got.logprobs).enumerate() {
            assert!(
                (lp - rows[j][t as usize].ln()).abs() < 1e-6,
                "seed {seed} row {j}"
            );
        }
        // The advanced chain's mu is the oracle's after every emitted token.
        let mut mu = 2.0 * tau;
        for (j, &t) in got.tokens.iter().enumerate() {
            let qj = kept(&target[j * 4..(j + 1) * 4], mu);
            mu -= eta * (-qj[t as usize].log2() - tau);
        }
        let got_mu = advanced.mirostat_mu().unwrap();
        assert!(
            (got_mu - mu).abs() < 1e-6,
            "seed {seed}: mu {got_mu} vs {mu}"
        );
    }
    assert!(checked > 290, "only {checked} trials away from boundaries");
}

#[test]
fn a_fixed_draft_is_accepted_at_each_position_with_the_ratio() {
    // The draft is fixed (ids [1, 0] with the rows of `case`): position 0 accepts with
    // probability min(1, p_0(1) / q_0(1)) and, once reached, position 1 with
    // min(1, p_1(0) / q_1(0)). Binomial counts over many seeds, 5 sigma each (false failure
    // about 6e-7 per check).
    let (target, draft) = case();
    let p: Vec<Vec<f64>> = target.chunks(4).map(softmax).collect();
    let ids = [1u32, 0];
    let want = [
        (p[0][1] / f64::from(draft[1])).min(1.0),
        (p[1][0] / f64::from(draft[4])).min(1.0),
    ];
    assert!(want[0] < 1.0 && want[1] < 1.0, "both ratios must be tested");
    let (mut reached, mut accepted) = ([0u64; 2], [0u64; 2]);
    for seed in 0..40_000u64 {
        let par = params(seed);
        let mut req =
            VerifyRequest::new(Verifier::Params(&par), &ids, TargetRows::Logits(&target), 4);
        req.draft_probs = Some(&draft);
        let got = verify(&req).unwrap();
        for i in 0..2 {
            if got.accepted >= i {
                reached[i] += 1;
                accepted[i] += u64::from(got.accepted > i);
            }
        }
    }
    for i in 0..2 {
        let n = reached[i] as f64;
        let rate = accepted[i] as f64 / n;
        let sigma = (want[i] * (1.0 - want[i]) / n).sqrt();
        assert!(
            (rate - want[i]).abs() < 5.0 * sigma,
            "position {i}: rate {rate} vs {} over {n}",
            want[i]
        );
    }
}

#[test]
fn min_tokens_counts_the_drafted_tokens() {
    // min_tokens 2 with one token generated: row 0 bans the stop id 3, row 1 (after one
    // drafted token) does not. Greedy: the stop id is every row's argmax.
    let target = [0.0f32, 1.0, 0.5, 9.0, 0.0, 1.0, 0.5, 9.0];
    let par = SamplingParams {
        temperature: 0.0,
        min_tokens: 2,
        seed: Some(1),
        ..Default::default()
    };
    let mut req = VerifyRequest::new(Verifier::Params(&par), &[1], TargetRows::Logits(&target), 4);
    req.output_ids = &[0];
    req.stop_token_ids = &[3];
    let got = verify(&req).unwrap();
    assert_eq!((got.accepted, &got.tokens[..]), (1, &[1u32, 3][..]));
    // The same with a chain.
    let c = chain(r#"[{"min_tokens": {"min_tokens": 2}}, {"greedy": {}}]"#);
    req.verifier = Verifier::Chain(&c);
    let got = verify(&req).unwrap();
    assert_eq!((got.accepted, &got.tokens[..]), (1, &[1u32, 3][..]));
}

#[test]
fn a_chain_is_refused_what_verification_cannot_do() {
    let target = [0.0f32; 8];
    for (json, field) in [
        (r#"[{"sample": {"n": 2, "seed": 1}}]"#, "n"),
        (r#"[{"sample": {"logprobs": 2, "seed": 1}}]"#, "logprobs"),
    ] {
        let c = chain(json);
        let req = VerifyRequest::new(Verifier::Chain(&c), &[0], TargetRows::Logits(&target), 4);
        match verify(&req) {
            Err(SampleError::InvalidParams(e)) => assert_eq!(e.field, field, "{json}"),
            other => panic!("{json}: {other:?}"),
        }
    }
    let c = chain(r#"[{"sample": {"seed": 1}}]"#);
    let req = VerifyRequest::new(Verifier::Chain(&c), &[0], TargetRows::Probs(&target), 4);
    match verify(&req) {
        Err(SampleError::InvalidParams(e)) => assert_eq!(e.field, "target"),
        other => panic!("{other:?}"),
    }
    let par = SamplingParams {
        n: 2,
        seed: Some(1),
        ..Default::default()
    };
    let req = VerifyRequest::new(Verifier::Params(&par), &[0], TargetRows::Logits(&target), 4);
    match verify(&req) {
        Err(SampleError::InvalidParams(e)) => assert_eq!(e.field, "n"),
        other => panic!("{other:?}"),
    }
}

#[test]
fn a_bad_target_row_is_an_error_whatever_the_draws() {
    // Row 0 is a coin flip for a one-hot draft of id 0 (p = 1/2); row 1 is bad. Every seed
    // gets the error, also those whose draft is rejected at row 0 (row 1 never processed).
    let bad_rows: [(&[f32], bool, &str); 4] = [
        (
            &[f32::NEG_INFINITY, f32::NEG_INFINITY],
            false,
            "no_candidates",
        ),
        (&[0.0, f32::NAN], false, "non_finite"),
        (&[0.5, -0.5], true, "invalid_probability"),
        (&[0.0, 0.0], true, "no_candidates"),
    ];
    for (row1, probs, what) in bad_rows {
        let mut target = vec![0.5f32, 0.5];
        target.extend_from_slice(row1);
        for seed in 0..40 {
            let par = params(seed);
            let rows = if probs {
                TargetRows::Probs(&target)
            } else {
                TargetRows::Logits(&target)
            };
            let got = verify(&VerifyRequest::new(Verifier::Params(&par), &[0], rows, 2));
            let ok = matches!(
                (what, &got),
                ("no_candidates", Err(SampleError::NoCandidates))
                    | (
                        "non_finite",
                        Err(SampleError::NonFiniteLogits { token_id: 1, .. })
                    )
                    | (
                        "invalid_probability",
                        Err(SampleError::InvalidProbability { token_id: 1, .. })
                    )
            );
            assert!(ok, "{what}, seed {seed}: {got:?}");
        }
    }
}

#[test]
fn positions_past_u64_and_raw_logprobs_are_refused() {
    let target = [0.0f32; 4];
    let par = params(1);
    let mut req = VerifyRequest::new(Verifier::Params(&par), &[0], TargetRows::Logits(&target), 2);
    req.position = u64::MAX;
    match verify(&req) {
        Err(SampleError::InvalidParams(e)) => assert_eq!(e.field, "position"),
        other => panic!("{other:?}"),
    }
    req.position = u64::MAX - 1;
    assert!(verify(&req).is_ok());
    let raw = SamplingParams {
        logprobs_kind: nucleus_sampling::LogprobsKind::Raw,
        ..params(1)
    };
    req.verifier = Verifier::Params(&raw);
    req.position = 0;
    match verify(&req) {
        Err(SampleError::InvalidParams(e)) => assert_eq!(e.field, "logprobs_kind"),
        other => panic!("{other:?}"),
    }
    let c = chain(r#"[{"sample": {"seed": 1, "logprobs_kind": "raw"}}]"#);
    req.verifier = Verifier::Chain(&c);
    match verify(&req) {
        Err(SampleError::InvalidParams(e)) => assert_eq!(e.field, "logprobs_kind"),
        other => panic!("{other:?}"),
    }
}
