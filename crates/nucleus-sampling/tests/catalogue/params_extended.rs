//! The `SamplingParams` path places each extended field where spec/sampling.md ("Extended
//! processors in the fixed path") says: each case below is order-sensitive, so a field at
//! another step gives another distribution, and the expected values are worked out by hand (in
//! f64) from the processors' definitions.

use crate::common;

use common::{assert_close, spec_uniform};
use nucleus_sampling::chain::{ProcessorContext, SamplerChain};
use nucleus_sampling::{
    distribution, distribution_from_probs, philox, sample_row, SampleError, SampleRequest,
    SamplingParams,
};

fn softmax(l: &[f64]) -> Vec<f64> {
    let m = l.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    let w: Vec<f64> = l.iter().map(|x| (x - m).exp()).collect();
    let z: f64 = w.iter().sum();
    w.iter().map(|x| x / z).collect()
}

fn dist(row: &[f32], p: &SamplingParams, prompt: &[u32], output: &[u32]) -> Vec<f64> {
    distribution(row, &SampleRequest::new(p, prompt, output, 7)).unwrap()
}

#[test]
fn sequence_bias_is_step_4a_before_the_repetition_penalty() {
    // logits [-1, 2, 0], token 0 in the prompt, sequence_bias [[0], +1.5], repetition 2.
    // 4a then 5: -1 + 1.5 = 0.5 > 0, so 0.5 / 2 = 0.25. (Penalty first: -2 + 1.5 = -0.5.)
    let p = SamplingParams {
        sequence_bias: vec![(vec![0], 1.5)],
        repetition_penalty: 2.0,
        seed: Some(1),
        ..Default::default()
    };
    let d = dist(&[-1.0, 2.0, 0.0], &p, &[0], &[]);
    assert_close(&d, &softmax(&[0.25, 2.0, 0.0]), 1e-6, "4a before 5");
    // A two-token sequence fires only when the sequence so far ends with its prefix [2].
    let p = SamplingParams {
        sequence_bias: vec![(vec![2, 1], -3.0)],
        seed: Some(1),
        ..Default::default()
    };
    assert_close(
        &dist(&[0.0, 1.0, 0.0], &p, &[0], &[2]),
        &softmax(&[0.0, -2.0, 0.0]),
        1e-6,
        "prefix matches",
    );
    assert_close(
        &dist(&[0.0, 1.0, 0.0], &p, &[0], &[0]),
        &softmax(&[0.0, 1.0, 0.0]),
        1e-6,
        "prefix does not match",
    );
}

#[test]
fn dry_is_step_5a_after_the_penalties_and_before_temperature() {
    // History [0, 1, 2, 0, 1] (prompt [0, 1, 2], output [0, 1]): the suffix [0, 1] occurred
    // before, followed by 2, so DRY penalises token 2 with a match of length 2; allowed_length
    // 1, base 2, multiplier 1: penalty 1 * 2^(2 - 1) = 2. Then temperature 0.5 divides: the
    // logits [0, 0, 3] become [0, 0, 3 - 2] / 0.5 = [0, 0, 2]. (Temperature first would give
    // 3 / 0.5 - 2 = 4.)
    let p = SamplingParams {
        dry_multiplier: 1.0,
        dry_base: 2.0,
        dry_allowed_length: 1,
        temperature: 0.5,
        seed: Some(1),
        ..Default::default()
    };
    let d = dist(&[0.0, 0.0, 3.0], &p, &[0, 1, 2], &[0, 1]);
    assert_close(&d, &softmax(&[0.0, 0.0, 2.0]), 1e-6, "DRY then temperature");
}

#[test]
fn no_repeat_ngram_is_step_5b_and_bans_the_completing_token() {
    // n = 2 over prompt + output [4, 1, 3, 4]: the last token 4 was followed by 1 before, so
    // 1 is banned; everything else keeps its logit.
    let p = SamplingParams {
        no_repeat_ngram_size: 2,
        seed: Some(1),
        ..Default::default()
    };
    let d = dist(&[0.0, 5.0, 1.0, 0.0, 0.0], &p, &[4, 1, 3], &[4]);
    let want = softmax(&[0.0, f64::NEG_INFINITY, 1.0, 0.0, 0.0]);
    assert_close(&d, &want, 1e-6, "n-gram ban");
}

#[test]
fn dynatemp_replaces_the_temperature_of_step_7() {
    // A uniform row over 4 tokens has normalised entropy 1, so the dynamic temperature is
    // T + range = 1.5 (exponent 1): [0, 0, 0, 0] stays uniform, and a following min_p sees the
    // same uniform probabilities. On [0, ln 2] (entropy below the maximum) the mapping gives
    // T_dyn = (T - r) + 2r * (H / ln 2) with H the entropy of softmax([0, ln 2]) = (1/3, 2/3).
    let (t, r) = (1.0, 0.5);
    let p = SamplingParams {
        temperature: t,
        dynatemp_range: r,
        seed: Some(1),
        ..Default::default()
    };
    let l1 = std::f64::consts::LN_2;
    let h = -(1.0f64 / 3.0 * (1.0f64 / 3.0).ln() + 2.0 / 3.0 * (2.0f64 / 3.0).ln());
    let t_dyn = (t - r) + 2.0 * r * (h / 2.0f64.ln());
    let d = dist(&[0.0, l1 as f32], &p, &[], &[]);
    assert_close(&d, &softmax(&[0.0, l1 / t_dyn]), 1e-6, "dynatemp");
    // Plain temperature 1 would leave (1/3, 2/3): the dynamic one differs.
    assert!((d[1] - 2.0 / 3.0).abs() > 1e-3, "{d:?}");
}

#[test]
fn filters_10a_to_10d_act_on_the_tempered_distribution_after_top_p() {
    // epsilon_cutoff 0.1 after temperature 2: logits [0, ln 4, ln 16] at T 2 give weights
    // (1, 2, 4)/7: token 0 has 1/7 = 0.143 >= 0.1 and stays. Before temperature it would have
    // 1/21 = 0.048 < 0.1 and go.
    let ln = |x: f64| x.ln() as f32;
    let row = [0.0, ln(4.0), ln(16.0)];
    let p = SamplingParams {
        temperature: 2.0,
        epsilon_cutoff: 0.1,
        seed: Some(1),
        ..Default::default()
    };
    assert_close(
        &dist(&row, &p, &[], &[]),
        &[1.0 / 7.0, 2.0 / 7.0, 4.0 / 7.0],
        1e-6,
        "epsilon",
    );
    // top_p 0.8 first keeps {2, 1} (4/7 < 0.8, 6/7 >= 0.8); then epsilon 0.4 on the
    // renormalised (1/3, 2/3) removes token 1 as well (1/3 < 0.4): only token 2 is left.
    let p = SamplingParams {
        temperature: 2.0,
        top_p: 0.8,
        epsilon_cutoff: 0.4,
        seed: Some(1),
        ..Default::default()
    };
    assert_close(
        &dist(&row, &p, &[], &[]),
        &[0.0, 0.0, 1.0],
        1e-6,
        "top_p then epsilon",
    );
    // min_keep 2 keeps the two best through the same filters.
    let p = SamplingParams { min_keep: 2, ..p };
    assert_close(
        &dist(&row, &p, &[], &[]),
        &[0.0, 1.0 / 3.0, 2.0 / 3.0],
        1e-6,
        "min_keep 2",
    );
}

#[test]
fn min_keep_applies_to_top_k() {
    // top_k 1 with min_keep 3 keeps 3 tokens (Hugging Face: k = max(top_k, min_keep)).
    let p = SamplingParams {
        top_k: 1,
        min_keep: 3,
        seed: Some(1),
        ..Default::default()
    };
    let row = [0.0f32, 1.0, 2.0, 3.0];
    assert_close(
        &dist(&row, &p, &[], &[]),
        &{
            let s = softmax(&[1.0, 2.0, 3.0]);
            [0.0, s[0], s[1], s[2]]
        },
        1e-6,
        "top_k 1, min_keep 3",
    );
}

#[test]
fn xtc_is_step_10e_after_top_k() {
    // probs (0.4, 0.3, 0.2, 0.1) as logits ln p; top_k 3 renormalises to (4/9, 3/9, 2/9); XTC
    // threshold 0.25, probability 1 (the coin always lands): tokens 0 and 1 are above 0.25,
    // the least likely of them (1) stays, 0 goes: (0, 3/5, 2/5, 0). XTC before top_k would see
    // 0.4 and 0.3 above 0.25 too, remove token 0, and top_k 3 would then keep {1, 2, 3}.
    let row: Vec<f32> = [0.4f64, 0.3, 0.2, 0.1]
        .iter()
        .map(|p| p.ln() as f32)
        .collect();
    let p = SamplingParams {
        top_k: 3,
        xtc_threshold: 0.25,
        xtc_probability: 1.0,
        seed: Some(1),
        ..Default::default()
    };
    assert_close(
        &dist(&row, &p, &[], &[]),
        &[0.0, 0.6, 0.4, 0.0],
        1e-6,
        "top_k then XTC",
    );
    // The coin: counter word 3 = 1. With probability 0.5, XTC acts exactly where that uniform
    // is <= 0.5; find one position of each kind and check both.
    let p = SamplingParams {
        xtc_probability: 0.5,
        ..p
    };
    let mut seen = [false, false];
    for position in 0..64u64 {
        let u = philox::uniform_kind(1, position, 0, philox::draw::XTC);
        let acts = u <= 0.5;
        let req = SampleRequest::new(&p, &[], &[], position);
        let d = distribution(&row, &req).unwrap();
        let want: &[f64] = if acts {
            &[0.0, 0.6, 0.4, 0.0]
        } else {
            &[4.0 / 9.0, 3.0 / 9.0, 2.0 / 9.0, 0.0]
        };
        assert_close(&d, want, 1e-6, &format!("position {position}, u {u}"));
        // And the token drawn is the inverse CDF of that distribution at the selection's
        // uniform (word 3 = 0).
        let out = sample_row(&row, &req).unwrap();
        let u0 = spec_uniform(1, position, 0);
        let mut acc = 0.0;
        let token = want.iter().position(|&q| {
            acc += q;
            acc > u0
        });
        assert_eq!(Some(out.token as usize), token, "position {position}");
        seen[acts as usize] = true;
    }
    assert_eq!(seen, [true, true]);
}

#[test]
fn mirostat_replaces_steps_8_to_11_and_its_mu_is_carried_by_the_caller() {
    // Mirostat 2 with tau 5 starts at mu = 10: it keeps the tokens of surprise -log2 p <= 10.
    // top_k 1 is ignored (mirostat replaces steps 8-11): the row (0.5, 0.25, 0.125, 0.125 and
    // a 2^-12 token) keeps the first four (surprise 1, 2, 3, 3 bits) and drops the last (12+).
    let probs = [0.5f64, 0.25, 0.125, 0.125 - 1.0 / 4096.0, 1.0 / 4096.0];
    let row: Vec<f32> = probs.iter().map(|p| p.ln() as f32).collect();
    let p = SamplingParams {
        mirostat: 2,
        mirostat_tau: 5.0,
        mirostat_eta: 0.1,
        top_k: 1,
        seed: Some(3),
        ..Default::default()
    };
    let d = dist(&row, &p, &[], &[]);
    let kept: f64 = probs[..4].iter().sum();
    let want: Vec<f64> = probs[..4].iter().map(|q| q / kept).chain([0.0]).collect();
    assert_close(&d, &want, 1e-6, "mirostat v2 at mu 10");

    // Three steps through sample_row, carrying mu, equal one chain kept across the steps; and
    // mu follows mu -= eta (-log2 p - tau) with p under the truncated distribution.
    let mut chain = SamplerChain::from_params(&p).unwrap();
    chain.reset(&[]);
    let mut output = Vec::new();
    let mut mu: Option<f64> = None;
    let mut hand_mu = 10.0f64;
    for step in 0..3u64 {
        let mut req = SampleRequest::new(&p, &[], &output, step);
        if let Some(m) = mu {
            req = req.with_mirostat_mu(m);
        }
        let fast_d = distribution(&row, &req).unwrap();
        let out = sample_row(&row, &req).unwrap();
        let ctx = ProcessorContext::new(&[], &output, step);
        let chained = chain.sample(&row, &ctx, 0).unwrap();
        assert_eq!(out.token, chained.token, "step {step}");
        chain.accept(chained.token);
        let pt = fast_d[out.token as usize];
        hand_mu -= 0.1 * (-pt.log2() - 5.0);
        let got = out.mirostat_mu.expect("mirostat reports mu");
        assert!(
            (got - hand_mu).abs() < 1e-9,
            "step {step}: {got} vs {hand_mu}"
        );
        assert_eq!(Some(got), chain.mirostat_mu());
        mu = Some(got);
        output.push(out.token);
    }
    // Without mirostat there is no mu.
    let plain = SamplingParams {
        seed: Some(3),
        ..Default::default()
    };
    let req = SampleRequest::new(&plain, &[], &[], 0);
    assert_eq!(sample_row(&row, &req).unwrap().mirostat_mu, None);
    // Greedy wins over mirostat (step 6 skips 7-11).
    let greedy = SamplingParams {
        temperature: 0.0,
        ..p
    };
    let req = SampleRequest::new(&greedy, &[], &[], 0);
    let out = sample_row(&row, &req).unwrap();
    assert_eq!((out.token, out.mirostat_mu), (0, None));
}

#[test]
fn extended_fields_are_errors_with_probability_input_and_out_of_range() {
    let p = SamplingParams {
        typical_p: 0.5,
        seed: Some(1),
        ..Default::default()
    };
    let req = SampleRequest::new(&p, &[], &[], 0);
    match distribution_from_probs(&[0.5, 0.5], &req) {
        Err(SampleError::InvalidParams(e)) => assert_eq!(e.field, "typical_p"),
        other => panic!("{other:?}"),
    }
    for (p, field) in [
        (
            SamplingParams {
                typical_p: 0.0,
                ..Default::default()
            },
            "typical_p",
        ),
        (
            SamplingParams {
                dry_multiplier: -1.0,
                ..Default::default()
            },
            "dry_multiplier",
        ),
        (
            SamplingParams {
                dry_base: 0.5,
                ..Default::default()
            },
            "dry_base",
        ),
        (
            SamplingParams {
                dry_penalty_last_n: -2,
                ..Default::default()
            },
            "dry_penalty_last_n",
        ),
        (
            SamplingParams {
                epsilon_cutoff: 1.0,
                ..Default::default()
            },
            "epsilon_cutoff",
        ),
        (
            SamplingParams {
                eta_cutoff: -0.1,
                ..Default::default()
            },
            "eta_cutoff",
        ),
        (
            SamplingParams {
                xtc_probability: 1.5,
                ..Default::default()
            },
            "xtc_probability",
        ),
        (
            SamplingParams {
                top_n_sigma: f64::NAN,
                ..Default::default()
            },
            "top_n_sigma",
        ),
        (
            SamplingParams {
                min_keep: 0,
                ..Default::default()
            },
            "min_keep",
        ),
        (
            SamplingParams {
                mirostat: 3,
                ..Default::default()
            },
            "mirostat",
        ),
        (
            SamplingParams {
                mirostat_tau: f64::INFINITY,
                ..Default::default()
            },
            "mirostat_tau",
        ),
        (
            SamplingParams {
                sequence_bias: vec![(vec![], 1.0)],
                ..Default::default()
            },
            "sequence_bias",
        ),
        (
            SamplingParams {
                dynatemp_range: -1.0,
                ..Default::default()
            },
            "dynatemp_range",
        ),
    ] {
        assert_eq!(p.validate().unwrap_err().field, field);
        let req = SampleRequest::new(&p, &[], &[], 0);
        match sample_row(&[0.0, 1.0], &req) {
            Err(SampleError::InvalidParams(e)) => assert_eq!(e.field, field),
            other => panic!("{field}: {other:?}"),
        }
    }
    // Ids held by the extended fields are checked against the vocabulary.
    let p = SamplingParams {
        sequence_bias: vec![(vec![9], 1.0)],
        seed: Some(1),
        ..Default::default()
    };
    let req = SampleRequest::new(&p, &[], &[], 0);
    assert!(matches!(
        sample_row(&[0.0, 1.0], &req),
        Err(SampleError::TokenIdOutOfRange { token_id: 9, .. })
    ));
}
