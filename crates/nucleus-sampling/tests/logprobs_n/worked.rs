//! `SamplingParams::n` and `SamplingParams::logprobs` (top-n log-probabilities, raw or
//! processed) on hand-worked rows, and their options and errors, against spec/sampling.md
//! ("Inputs", step 2, "Random streams", "Outputs") and the public API docs. Random rows against
//! the f64 oracle, the `n` samples' streams, their statistics and batch invariance are in
//! `logprobs_n/oracle.rs`; how the expectations are computed is in `common/logprobs_n.rs`.

use crate::common;

use common::logprobs_n::*;
use common::{normal_row, spec_uniform};
use nucleus_sampling::{
    sample_batch, sample_row, sample_row_from_probs, LogitsView, LogprobsKind, SampleError,
    SampleRequest, SamplingParams, MAX_N,
};
use std::collections::BTreeMap;

// ---------------------------------------------------------------------------------------------
// Hand-worked cases.
// ---------------------------------------------------------------------------------------------

/// probs [0.4, 0.3, 0.2, 0.1], top_k 2 (spec worked case -> [4/7, 3/7, 0, 0]):
/// processed top 3 = [(0, ln 4/7), (1, ln 3/7), (2, -inf)], raw top 2 = [(0, ln .4), (1, ln .3)].
#[test]
fn probs_top_k_2_processed_and_raw_top() {
    let probs = [0.4f32, 0.3, 0.2, 0.1];
    // The f32 values are not the decimals: the exact expectations use them.
    let p: Vec<f64> = probs.iter().map(|&x| f64::from(x)).collect();
    let sum: f64 = p.iter().sum();
    let (p4_7, p3_7) = (p[0] / (p[0] + p[1]), p[1] / (p[0] + p[1]));

    let processed = SamplingParams {
        top_k: 2,
        seed: Some(5),
        n: 6,
        logprobs: Some(3),
        logprobs_kind: LogprobsKind::Processed,
        ..Default::default()
    };
    let out = sample_row_from_probs(&probs, &req(&processed)).unwrap();
    let lp = logprobs_of(&out);
    assert_eq!(lp.kind, LogprobsKind::Processed);
    assert_top(
        &lp.top,
        &[(0, p4_7.ln()), (1, p3_7.ln()), (2, f64::NEG_INFINITY)],
        1e-12,
        0.0,
        "processed top 3",
    );
    // The decimal reading of the hand-worked values (f32 rounding of 0.4, 0.3 is ~1e-8).
    assert_value(lp.top[0].logprob, (4.0f64 / 7.0).ln(), 1e-7, 0.0, "ln 4/7");
    assert_value(lp.top[1].logprob, (3.0f64 / 7.0).ln(), 1e-7, 0.0, "ln 3/7");
    // Six samples, all from {0, 1}, each with its processed logprob.
    let tokens: Vec<u32> = out.tokens().collect();
    assert_eq!(tokens.len(), 6);
    assert_eq!(out.extra_samples.len(), 5);
    assert_eq!(lp.sampled.len(), 6);
    for (j, (&t, &s)) in tokens.iter().zip(&lp.sampled).enumerate() {
        let want = match t {
            0 => p4_7.ln(),
            1 => p3_7.ln(),
            _ => panic!("sample {j} is token {t}, outside top_k 2"),
        };
        assert_value(s, want, 1e-12, 0.0, &format!("sampled[{j}]"));
        assert_value(
            sampled_logprobs(&out)[j],
            want,
            1e-12,
            0.0,
            &format!("Sample.logprob[{j}]"),
        );
    }
    // Both tokens appear among the draws of the spec's inverse CDF over these 6 uniforms.
    for (j, &t) in tokens.iter().enumerate() {
        let u = spec_uniform(5, 0, j as u32);
        assert_eq!(t, if u < p4_7 { 0 } else { 1 }, "sample {j}, u {u}");
    }

    // Asking for all 4: padding with the lowest ids not already listed, -inf.
    let all4 = SamplingParams {
        logprobs: Some(4),
        ..processed.clone()
    };
    let out = sample_row_from_probs(&probs, &req(&all4)).unwrap();
    assert_top(
        &logprobs_of(&out).top,
        &[
            (0, p4_7.ln()),
            (1, p3_7.ln()),
            (2, f64::NEG_INFINITY),
            (3, f64::NEG_INFINITY),
        ],
        1e-12,
        0.0,
        "processed top 4",
    );

    let raw = SamplingParams {
        logprobs: Some(2),
        logprobs_kind: LogprobsKind::Raw,
        ..processed.clone()
    };
    let out = sample_row_from_probs(&probs, &req(&raw)).unwrap();
    let lp = logprobs_of(&out);
    assert_eq!(lp.kind, LogprobsKind::Raw);
    assert_top(
        &lp.top,
        &[(0, (p[0] / sum).ln()), (1, (p[1] / sum).ln())],
        1e-12,
        0.0,
        "raw top 2",
    );
    assert_value(lp.top[0].logprob, 0.4f64.ln(), 1e-7, 0.0, "ln .4");
    assert_value(lp.top[1].logprob, 0.3f64.ln(), 1e-7, 0.0, "ln .3");
    // Raw sampled logprobs are the raw values of the sampled tokens; Sample.logprob stays
    // processed.
    for (j, t) in out.tokens().enumerate() {
        assert_value(
            lp.sampled[j],
            (p[t as usize] / sum).ln(),
            1e-12,
            0.0,
            "raw sampled",
        );
    }
    for (j, t) in out.tokens().enumerate() {
        let want = if t == 0 { p4_7.ln() } else { p3_7.ln() };
        assert_value(
            sampled_logprobs(&out)[j],
            want,
            1e-12,
            0.0,
            "processed Sample.logprob",
        );
    }
}

/// Dyadic probabilities: every value exact. Unnormalised weights [4, 2, 1, 1] (sum 8):
/// raw = [ln .5, ln .25, ln .125, ln .125] (tie 2/3 toward the lower id); top_k 2 ->
/// processed [ln 2/3, ln 1/3, -inf, -inf]; zeros are -inf in raw too.
#[test]
fn dyadic_probability_rows_exact_values() {
    let probs = [4.0f32, 2.0, 1.0, 1.0];
    let raw = SamplingParams {
        top_k: 2,
        seed: Some(1),
        logprobs: Some(4),
        logprobs_kind: LogprobsKind::Raw,
        ..Default::default()
    };
    let out = sample_row_from_probs(&probs, &req(&raw)).unwrap();
    assert_top(
        &logprobs_of(&out).top,
        &[
            (0, 0.5f64.ln()),
            (1, 0.25f64.ln()),
            (2, 0.125f64.ln()),
            (3, 0.125f64.ln()),
        ],
        1e-15,
        0.0,
        "raw, dyadic",
    );
    let processed = SamplingParams {
        logprobs_kind: LogprobsKind::Processed,
        ..raw.clone()
    };
    let out = sample_row_from_probs(&probs, &req(&processed)).unwrap();
    assert_top(
        &logprobs_of(&out).top,
        &[
            (0, (2.0f64 / 3.0).ln()),
            (1, (1.0f64 / 3.0).ln()),
            (2, f64::NEG_INFINITY),
            (3, f64::NEG_INFINITY),
        ],
        1e-15,
        0.0,
        "processed, dyadic",
    );

    // Zeros in the row as given: -inf in raw, listed after every possible token, by id.
    let probs = [0.0f32, 2.0, 6.0, 0.0];
    let p = SamplingParams {
        seed: Some(2),
        logprobs: Some(4),
        logprobs_kind: LogprobsKind::Raw,
        ..Default::default()
    };
    let out = sample_row_from_probs(&probs, &req(&p)).unwrap();
    assert_top(
        &logprobs_of(&out).top,
        &[
            (2, 0.75f64.ln()),
            (1, 0.25f64.ln()),
            (0, f64::NEG_INFINITY),
            (3, f64::NEG_INFINITY),
        ],
        1e-15,
        0.0,
        "raw with zeros",
    );
    // Processed: the same values here (no filter, temperature 1).
    let p = SamplingParams {
        logprobs_kind: LogprobsKind::Processed,
        ..p
    };
    let out = sample_row_from_probs(&probs, &req(&p)).unwrap();
    assert_top(
        &logprobs_of(&out).top,
        &[
            (2, 0.75f64.ln()),
            (1, 0.25f64.ln()),
            (0, f64::NEG_INFINITY),
            (3, f64::NEG_INFINITY),
        ],
        1e-15,
        0.0,
        "processed with zeros",
    );
}

/// Logits [1, 3, 3, 2, 3]: ids 1, 2, 4 tie. Every top list orders ties toward the lower id;
/// exact-k top_k 2 keeps {1, 2} (each exactly 1/2), top_k 3 keeps {1, 2, 4} (each 1/3).
#[test]
fn ties_go_to_the_lower_id() {
    let row = [1.0f32, 3.0, 3.0, 2.0, 3.0];
    let raw_want = log_softmax(&row);
    let raw = SamplingParams {
        seed: Some(3),
        n: 2,
        logprobs: Some(5),
        logprobs_kind: LogprobsKind::Raw,
        ..Default::default()
    };
    let out = sample_row(&row, &req(&raw)).unwrap();
    assert_top(
        &logprobs_of(&out).top,
        &[
            (1, raw_want[1]),
            (2, raw_want[2]),
            (4, raw_want[4]),
            (3, raw_want[3]),
            (0, raw_want[0]),
        ],
        1e-9,
        0.0,
        "raw ties",
    );
    // Exactly equal values for the tied ids (identical inputs, identical arithmetic).
    let top = &logprobs_of(&out).top;
    assert_eq!(top[0].logprob.to_bits(), top[1].logprob.to_bits());
    assert_eq!(top[1].logprob.to_bits(), top[2].logprob.to_bits());
    // Hand value: ln(1 / (3 + e^-1 + e^-2)).
    let z = 3.0 + (-1.0f64).exp() + (-2.0f64).exp();
    assert_value(top[0].logprob, -(z.ln()), 1e-12, 0.0, "raw hand value");

    // Processed, no filter: the same order; values within f32 weight rounding of f64.
    let processed = SamplingParams {
        logprobs_kind: LogprobsKind::Processed,
        ..raw.clone()
    };
    let out = sample_row(&row, &req(&processed)).unwrap();
    assert_top(
        &logprobs_of(&out).top,
        &[
            (1, raw_want[1]),
            (2, raw_want[2]),
            (4, raw_want[4]),
            (3, raw_want[3]),
            (0, raw_want[0]),
        ],
        1e-6,
        0.0,
        "processed ties",
    );

    // top_k 2: exactly {1, 2}, each exactly 1/2; padding by the lowest ids not listed: 0, 3.
    let k2 = SamplingParams {
        top_k: 2,
        logprobs: Some(4),
        n: 5,
        ..processed.clone()
    };
    let out = sample_row(&row, &req(&k2)).unwrap();
    let half = 0.5f64.ln();
    assert_top(
        &logprobs_of(&out).top,
        &[
            (1, half),
            (2, half),
            (0, f64::NEG_INFINITY),
            (3, f64::NEG_INFINITY),
        ],
        1e-15,
        0.0,
        "top_k 2",
    );
    for (j, t) in out.tokens().enumerate() {
        assert!(t == 1 || t == 2, "sample {j}: token {t}");
        assert_value(sampled_logprobs(&out)[j], half, 1e-15, 0.0, "ln 1/2");
        assert_value(logprobs_of(&out).sampled[j], half, 1e-15, 0.0, "sampled");
        let u = spec_uniform(3, 0, j as u32);
        assert_eq!(t, if u < 0.5 { 1 } else { 2 }, "sample {j}, u {u}");
    }

    // A wide row with few survivors: ties among them still go to the lower id.
    let mut wide = vec![-5.0f32; 1000];
    for id in [700, 300, 500] {
        wide[id] = 3.0;
    }
    wide[10] = 2.0;
    wide[900] = 2.0;
    let raw_wide = log_softmax(&wide);
    let p = SamplingParams {
        top_k: 4,
        seed: Some(12),
        n: 4,
        logprobs: Some(6),
        ..Default::default()
    };
    let out = sample_row(&wide, &req(&p)).unwrap();
    let z = 3.0 + (-1.0f64).exp();
    let (a, b) = (-(z.ln()), -1.0 - z.ln());
    assert_top(
        &logprobs_of(&out).top,
        &[
            (300, a),
            (500, a),
            (700, a),
            (10, b),
            (0, f64::NEG_INFINITY),
            (1, f64::NEG_INFINITY),
        ],
        1e-6,
        0.0,
        "wide processed",
    );
    let p = SamplingParams {
        logprobs_kind: LogprobsKind::Raw,
        ..p
    };
    let out = sample_row(&wide, &req(&p)).unwrap();
    assert_top(
        &logprobs_of(&out).top,
        &ranked(&raw_wide, 6),
        1e-9,
        0.0,
        "wide raw",
    );
    let ids: Vec<u32> = logprobs_of(&out).top.iter().map(|t| t.token_id).collect();
    assert_eq!(ids, vec![300, 500, 700, 10, 900, 0]);

    // top_k 3: {1, 2, 4}, each 1/3.
    let k3 = SamplingParams {
        top_k: 3,
        logprobs: Some(5),
        ..processed
    };
    let out = sample_row(&row, &req(&k3)).unwrap();
    let third = (1.0f64 / 3.0).ln();
    assert_top(
        &logprobs_of(&out).top,
        &[
            (1, third),
            (2, third),
            (4, third),
            (0, f64::NEG_INFINITY),
            (3, f64::NEG_INFINITY),
        ],
        1e-15,
        0.0,
        "top_k 3",
    );
}

/// Greedy (temperature 0 and below 1e-5): processed is one-hot on the argmax (ties to the
/// lowest id) with logprob exactly 0; every one of n samples is that token with logprob 0; raw
/// logprobs are the log-softmax of the row regardless.
#[test]
fn greedy_is_one_hot_with_logprob_zero() {
    let row = [1.0f32, 5.0, 5.0, 2.0];
    let raw_want = log_softmax(&row);
    for temperature in [0.0, 9e-6] {
        let p = SamplingParams {
            temperature,
            seed: Some(4),
            n: 4,
            logprobs: Some(3),
            ..Default::default()
        };
        let out = sample_row(&row, &req(&p)).unwrap();
        assert_eq!(out.tokens().collect::<Vec<_>>(), vec![1; 4]);
        assert_eq!(sampled_logprobs(&out), vec![0.0; 4]);
        for x in sampled_logprobs(&out) {
            assert!(x.is_sign_positive(), "logprob -0.0");
        }
        let lp = logprobs_of(&out);
        assert_eq!(lp.kind, LogprobsKind::Processed);
        assert_eq!(lp.sampled, vec![0.0; 4]);
        assert_top(
            &lp.top,
            &[(1, 0.0), (0, f64::NEG_INFINITY), (2, f64::NEG_INFINITY)],
            0.0,
            0.0,
            "greedy processed",
        );

        let raw = SamplingParams {
            logprobs_kind: LogprobsKind::Raw,
            ..p
        };
        let out = sample_row(&row, &req(&raw)).unwrap();
        assert_eq!(sampled_logprobs(&out), vec![0.0; 4]);
        let lp = logprobs_of(&out);
        assert_eq!(lp.kind, LogprobsKind::Raw);
        for &s in &lp.sampled {
            assert_value(s, raw_want[1], 1e-9, 0.0, "greedy raw sampled");
        }
        assert_top(
            &lp.top,
            &[(1, raw_want[1]), (2, raw_want[2]), (3, raw_want[3])],
            1e-9,
            0.0,
            "greedy raw",
        );
    }

    // Greedy on probability input, with a mask: one-hot on the allowed maximum.
    let p = SamplingParams {
        allowed_token_ids: Some(vec![1, 2]),
        n: 3,
        logprobs: Some(2),
        ..SamplingParams::greedy()
    };
    let out = sample_row_from_probs(&[0.4, 0.3, 0.2, 0.1], &req(&p)).unwrap();
    assert_eq!(out.tokens().collect::<Vec<_>>(), vec![1; 3]);
    assert_top(
        &logprobs_of(&out).top,
        &[(1, 0.0), (0, f64::NEG_INFINITY)],
        0.0,
        0.0,
        "greedy probs processed",
    );
}

/// top_k 1 equals greedy (spec step 9): one survivor of probability 1, so every sample is the
/// argmax with processed logprob exactly 0, and the processed top is one-hot.
#[test]
fn top_k_1_equals_greedy() {
    let row = normal_row(77, 300, 2.0);
    let argmax = ranked(&log_softmax(&row), 1)[0].0;
    let p = SamplingParams {
        temperature: 0.7,
        top_k: 1,
        seed: Some(8),
        n: 5,
        logprobs: Some(3),
        ..Default::default()
    };
    let out = sample_row(&row, &req(&p)).unwrap();
    let greedy = sample_row(
        &row,
        &req(&SamplingParams {
            temperature: 0.0,
            top_k: 0,
            ..p.clone()
        }),
    )
    .unwrap();
    assert_eq!(out.tokens().collect::<Vec<_>>(), vec![argmax; 5]);
    assert_eq!(greedy.tokens().collect::<Vec<_>>(), vec![argmax; 5]);
    assert_eq!(sampled_logprobs(&out), vec![0.0; 5]);
    assert_eq!(logprobs_of(&out).sampled, vec![0.0; 5]);
    let lowest_others: Vec<u32> = (0..3).filter(|&i| i != argmax).take(2).collect();
    let want = [
        (argmax, 0.0),
        (lowest_others[0], f64::NEG_INFINITY),
        (lowest_others[1], f64::NEG_INFINITY),
    ];
    assert_top(&logprobs_of(&out).top, &want, 0.0, 0.0, "top_k 1");
    assert_top(&logprobs_of(&greedy).top, &want, 0.0, 0.0, "greedy");
    assert_eq!(out.num_candidates, 1);
}

/// A token removed by allowed_token_ids is in the raw top (step 2 comes before step 3) and is
/// -inf in the processed top; bias and temperature move the processed values only.
#[test]
fn masked_token_appears_in_raw_but_not_processed() {
    let row = [3.0f32, 1.0, 2.0, 0.0];
    let raw_want = log_softmax(&row);
    let base = SamplingParams {
        allowed_token_ids: Some(vec![1, 2, 3]),
        seed: Some(11),
        n: 8,
        logprobs: Some(4),
        logprobs_kind: LogprobsKind::Raw,
        ..Default::default()
    };
    let out = sample_row(&row, &req(&base)).unwrap();
    let lp = logprobs_of(&out);
    assert_top(
        &lp.top,
        &[
            (0, raw_want[0]),
            (2, raw_want[2]),
            (1, raw_want[1]),
            (3, raw_want[3]),
        ],
        1e-9,
        0.0,
        "raw with mask",
    );
    assert!(out.tokens().all(|t| t != 0), "a masked token was sampled");
    for (j, t) in out.tokens().enumerate() {
        assert_value(
            lp.sampled[j],
            raw_want[t as usize],
            1e-9,
            0.0,
            "raw sampled",
        );
    }

    // Processed: softmax over {1, 2, 3} of [1, 2, 0]; 0 is -inf and last.
    let z = 1.0f64.exp() + 2.0f64.exp() + 1.0;
    let processed = SamplingParams {
        logprobs_kind: LogprobsKind::Processed,
        ..base.clone()
    };
    let out = sample_row(&row, &req(&processed)).unwrap();
    let lp = logprobs_of(&out);
    assert_top(
        &lp.top,
        &[
            (2, 2.0 - z.ln()),
            (1, 1.0 - z.ln()),
            (3, -z.ln()),
            (0, f64::NEG_INFINITY),
        ],
        1e-6,
        0.0,
        "processed with mask",
    );
    for (j, t) in out.tokens().enumerate() {
        let want = [f64::NEG_INFINITY, 1.0 - z.ln(), 2.0 - z.ln(), -z.ln()][t as usize];
        assert_value(lp.sampled[j], want, 1e-6, 0.0, "processed sampled");
        assert_value(
            lp.sampled[j],
            sampled_logprobs(&out)[j],
            1e-12,
            1e-12,
            "processed sampled vs the sample's own logprob",
        );
    }

    // Bias +3 on id 3 and temperature 0.5: processed = log_softmax([1, 2, 3] / 0.5) over
    // {1, 2, 3}; the raw top is unchanged (bitwise).
    let moved = SamplingParams {
        logit_bias: BTreeMap::from([(3, 3.0)]),
        temperature: 0.5,
        ..processed.clone()
    };
    let out = sample_row(&row, &req(&moved)).unwrap();
    let z = 2.0f64.exp() + 4.0f64.exp() + 6.0f64.exp();
    assert_top(
        &logprobs_of(&out).top,
        &[
            (3, 6.0 - z.ln()),
            (2, 4.0 - z.ln()),
            (1, 2.0 - z.ln()),
            (0, f64::NEG_INFINITY),
        ],
        1e-6,
        0.0,
        "processed, bias and temperature",
    );
    let raw_moved = SamplingParams {
        logprobs_kind: LogprobsKind::Raw,
        ..moved
    };
    let a = sample_row(&row, &req(&raw_moved)).unwrap();
    let b = sample_row(&row, &req(&base)).unwrap();
    assert_eq!(
        format!("{:?}", logprobs_of(&a).top),
        format!("{:?}", logprobs_of(&b).top),
        "raw top depends on bias / temperature"
    );
}

/// The raw top is the log-softmax of the row as given, bitwise the same whatever the
/// processing (constraints, bias, penalties, temperature, min_p, top_k, top_p, greedy).
#[test]
fn raw_logprobs_ignore_every_processing_step() {
    let vocab = 64;
    let row = normal_row(5, vocab, 2.0);
    let want = log_softmax(&row);
    let prompt = [1u32, 2, 3, 9, 9];
    let output = [4u32, 4, 5, 6];
    let stops = [7u32];
    let variants = [
        SamplingParams::default(),
        SamplingParams::greedy(),
        SamplingParams {
            temperature: 0.3,
            top_k: 5,
            top_p: 0.7,
            min_p: 0.1,
            ..Default::default()
        },
        SamplingParams {
            repetition_penalty: 1.7,
            presence_penalty: 2.0,
            frequency_penalty: -1.5,
            logit_bias: BTreeMap::from([(0, 100.0), (1, -300.0)]),
            ..Default::default()
        },
        SamplingParams {
            allowed_token_ids: Some(vec![10, 20, 30]),
            bad_words: vec![vec![20], vec![6, 30]],
            min_tokens: 100,
            ..Default::default()
        },
    ];
    let mut first: Option<String> = None;
    for (i, v) in variants.into_iter().enumerate() {
        let p = SamplingParams {
            seed: Some(i as u64),
            n: 3,
            logprobs: Some(vocab),
            logprobs_kind: LogprobsKind::Raw,
            ..v
        };
        let r = SampleRequest::new(&p, &prompt, &output, 9).with_stop_token_ids(&stops);
        let out = sample_row(&row, &r).unwrap();
        let lp = logprobs_of(&out);
        assert_eq!(lp.kind, LogprobsKind::Raw);
        assert_top(
            &lp.top,
            &ranked(&want, vocab),
            1e-9,
            0.0,
            &format!("variant {i}"),
        );
        for (j, t) in out.tokens().enumerate() {
            assert_value(
                lp.sampled[j],
                want[t as usize],
                1e-9,
                0.0,
                &format!("variant {i} sampled {j}"),
            );
        }
        let text = format!("{:?}", lp.top);
        match &first {
            None => first = Some(text),
            Some(f) => assert_eq!(f, &text, "variant {i}: raw top not bitwise stable"),
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Options and errors.
// ---------------------------------------------------------------------------------------------

/// `logprobs: None` -> no logprobs; `Some(0)` -> the sampled ones only, top empty;
/// `Some(vocab_size)` is allowed, `Some(vocab_size + 1)` is `InvalidParams` naming "logprobs".
#[test]
fn logprobs_none_zero_and_range() {
    let row = [0.5f32, 1.5, -1.0];
    let none = SamplingParams {
        seed: Some(1),
        n: 2,
        ..Default::default()
    };
    assert_eq!(none.logprobs, None);
    assert_eq!(none.logprobs_kind, LogprobsKind::Processed);
    assert_eq!(SamplingParams::default().n, 1);
    let out = sample_row(&row, &req(&none)).unwrap();
    assert!(out.logprobs.is_none());
    assert_eq!(out.extra_samples.len(), 1);

    for kind in [LogprobsKind::Raw, LogprobsKind::Processed] {
        let zero = SamplingParams {
            logprobs: Some(0),
            logprobs_kind: kind,
            ..none.clone()
        };
        let out = sample_row(&row, &req(&zero)).unwrap();
        let lp = logprobs_of(&out);
        assert_eq!(lp.kind, kind);
        assert!(lp.top.is_empty());
        assert_eq!(lp.sampled.len(), 2);

        let all = SamplingParams {
            logprobs: Some(3),
            ..zero.clone()
        };
        assert_eq!(
            logprobs_of(&sample_row(&row, &req(&all)).unwrap())
                .top
                .len(),
            3
        );

        let too_many = SamplingParams {
            logprobs: Some(4),
            ..zero.clone()
        };
        too_many.validate().unwrap(); // the vocabulary is not known to validate()
        match sample_row(&row, &req(&too_many)) {
            Err(SampleError::InvalidParams(e)) => assert_eq!(e.field, "logprobs"),
            other => panic!("logprobs 4 > vocab 3: {other:?}"),
        }
        let greedy_too_many = SamplingParams {
            temperature: 0.0,
            ..too_many.clone()
        };
        match sample_row(&row, &req(&greedy_too_many)) {
            Err(SampleError::InvalidParams(e)) => assert_eq!(e.field, "logprobs"),
            other => panic!("greedy, logprobs 4 > vocab 3: {other:?}"),
        }
        match sample_row_from_probs(&[0.2, 0.3, 0.5], &req(&too_many)) {
            Err(SampleError::InvalidParams(e)) => assert_eq!(e.field, "logprobs"),
            other => panic!("probs, logprobs 4 > vocab 3: {other:?}"),
        }
    }
}

/// `vocab_size` is the view's, not the row length: padding ids are never listed and count for
/// neither the logprobs bound nor the raw softmax; a bad row errs alone in its batch.
#[test]
fn padded_rows_logprobs_use_vocab_size() {
    let (row_len, vocab) = (8, 5);
    let data = [
        1.0f32,
        2.0,
        0.5,
        f32::NEG_INFINITY,
        2.0,
        f32::NAN,
        1e30,
        1e30, // row 0
        1.0,
        2.0,
        0.5,
        f32::NEG_INFINITY,
        2.0,
        f32::NAN,
        1e30,
        1e30, // row 1
    ];
    let view = LogitsView::new(&data, 2, row_len, row_len, vocab).unwrap();
    let ok = SamplingParams {
        seed: Some(6),
        n: 3,
        logprobs: Some(5),
        logprobs_kind: LogprobsKind::Raw,
        ..Default::default()
    };
    let bad = SamplingParams {
        logprobs: Some(6),
        ..ok.clone()
    };
    let out = sample_batch(&view, &[req(&bad), req(&ok)]).unwrap();
    match &out[0] {
        Err(SampleError::InvalidParams(e)) => assert_eq!(e.field, "logprobs"),
        other => panic!("logprobs 6 > vocab 5: {other:?}"),
    }
    let good = out[1].as_ref().unwrap();
    let raw = log_softmax(&data[..vocab]);
    assert_top(
        &logprobs_of(good).top,
        &[
            (1, raw[1]),
            (4, raw[4]),
            (0, raw[0]),
            (2, raw[2]),
            (3, f64::NEG_INFINITY),
        ],
        1e-9,
        0.0,
        "padded raw",
    );
    assert!(good.tokens().all(|t| (t as usize) < vocab && t != 3));
    assert!(same(good, &sample_row(&data[..vocab], &req(&ok)).unwrap()));

    // Processed with top_k 2 and 5 asked: {1, 4} (ln 1/2 each), then -inf for 0, 2, 3.
    let k2 = SamplingParams {
        top_k: 2,
        logprobs_kind: LogprobsKind::Processed,
        ..ok
    };
    let out = sample_batch(&view, &[req(&k2), req(&k2)]).unwrap();
    let half = 0.5f64.ln();
    for r in &out {
        assert_top(
            &logprobs_of(r.as_ref().unwrap()).top,
            &[
                (1, half),
                (4, half),
                (0, f64::NEG_INFINITY),
                (2, f64::NEG_INFINITY),
                (3, f64::NEG_INFINITY),
            ],
            1e-15,
            0.0,
            "padded processed",
        );
    }
}

/// n outside 1..=1024: `validate()` gives a ParamError naming "n"; sampling gives InvalidParams
/// naming "n" for that row only.
#[test]
fn n_out_of_range_is_an_error_naming_n() {
    let row = [0.0f32, 1.0, 2.0, 3.0];
    for n in [0usize, MAX_N + 1, usize::MAX] {
        let p = SamplingParams {
            seed: Some(1),
            n,
            logprobs: Some(2),
            ..Default::default()
        };
        let e = p.validate().unwrap_err();
        assert_eq!(e.field, "n", "n = {n}");
        assert_eq!(e.value, n.to_string());
        match sample_row(&row, &req(&p)) {
            Err(SampleError::InvalidParams(e)) => assert_eq!(e.field, "n"),
            other => panic!("n = {n}: {other:?}"),
        }
        let greedy = SamplingParams {
            temperature: 0.0,
            ..p.clone()
        };
        match sample_row(&row, &req(&greedy)) {
            Err(SampleError::InvalidParams(e)) => assert_eq!(e.field, "n"),
            other => panic!("greedy, n = {n}: {other:?}"),
        }
        match sample_row_from_probs(&[0.1, 0.2, 0.3, 0.4], &req(&p)) {
            Err(SampleError::InvalidParams(e)) => assert_eq!(e.field, "n"),
            other => panic!("probs, n = {n}: {other:?}"),
        }
        let healthy = SamplingParams {
            seed: Some(2),
            ..Default::default()
        };
        let data = [row, row].concat();
        let out = sample_batch(
            &LogitsView::dense(&data, 2, 4).unwrap(),
            &[req(&healthy), req(&p)],
        )
        .unwrap();
        assert!(out[0].is_ok());
        assert!(matches!(&out[1], Err(SampleError::InvalidParams(e)) if e.field == "n"));
    }
    for n in [1usize, 2, MAX_N] {
        SamplingParams {
            n,
            ..Default::default()
        }
        .validate()
        .unwrap();
    }
}

/// Raw logprobs are captured before the constraints, but a row with no candidate after step 3
/// is still `NoCandidates` (step 12), whatever logprobs were asked for.
#[test]
fn no_candidates_is_an_error_even_with_raw_logprobs() {
    let row = [1.0f32, f32::NEG_INFINITY, 0.0];
    for kind in [LogprobsKind::Raw, LogprobsKind::Processed] {
        let p = SamplingParams {
            allowed_token_ids: Some(vec![1]),
            seed: Some(3),
            n: 2,
            logprobs: Some(3),
            logprobs_kind: kind,
            ..Default::default()
        };
        assert_eq!(sample_row(&row, &req(&p)), Err(SampleError::NoCandidates));
    }
}
