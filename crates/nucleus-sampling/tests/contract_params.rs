//! Worked cases of spec/sampling.md for min_p, frequency / presence penalties, logit_bias,
//! allowed_token_ids, bad_words and min_tokens, each against values computed here by hand.

use std::collections::BTreeMap;

use nucleus_sampling::{distribution, sample_row, SampleError, SampleRequest, SamplingParams};

/// softmax in f64 of `logits`, -inf entries 0.
fn softmax(logits: &[f64]) -> Vec<f64> {
    let m = logits.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    let w: Vec<f64> = logits.iter().map(|&l| (l - m).exp()).collect();
    let z: f64 = w.iter().sum();
    w.iter().map(|x| x / z).collect()
}

fn assert_close(got: &[f64], want: &[f64]) {
    assert_eq!(got.len(), want.len());
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!(
            (g - w).abs() < 1e-6,
            "entry {i}: got {got:?}, want {want:?}"
        );
    }
}

#[test]
fn spec_case_repetition_then_frequency_and_presence() {
    // logits [1, 1, 1], prompt [2], generated [0, 0, 1], repetition 2, frequency 0.5,
    // presence 0.5 -> processed logits [-1, -0.5, 0.5].
    let params = SamplingParams {
        repetition_penalty: 2.0,
        frequency_penalty: 0.5,
        presence_penalty: 0.5,
        ..Default::default()
    };
    let req = SampleRequest::new(&params, &[2], &[0, 0, 1], 4);
    let p = distribution(&[1.0, 1.0, 1.0], &req).unwrap();
    assert_close(&p, &softmax(&[-1.0, -0.5, 0.5]));
}

#[test]
fn frequency_and_presence_ignore_prompt_ids() {
    let params = SamplingParams {
        frequency_penalty: 2.0,
        presence_penalty: 2.0,
        ..Default::default()
    };
    // Token 0 is only in the prompt: unpenalised. Token 1 generated once: -4.
    let req = SampleRequest::new(&params, &[0, 0, 0], &[1], 4);
    let p = distribution(&[0.0, 0.0], &req).unwrap();
    assert_close(&p, &softmax(&[0.0, -4.0]));
}

#[test]
fn negative_penalties_encourage_repetition() {
    let params = SamplingParams {
        frequency_penalty: -1.0,
        presence_penalty: -0.5,
        ..SamplingParams::greedy()
    };
    // Token 2 generated twice: 0 + 2 + 0.5 = 2.5 beats token 0's 2.
    let req = SampleRequest::new(&params, &[], &[2, 2], 2);
    assert_eq!(sample_row(&[2.0, 0.0, 0.0], &req).unwrap().token, 2);
}

#[test]
fn min_p_keeps_tokens_at_or_above_the_scaled_maximum() {
    // probs [0.4, 0.3, 0.2, 0.1] as logits; min_p 0.6 keeps p >= 0.24: tokens 0 and 1.
    let logits: Vec<f32> = [0.4f64, 0.3, 0.2, 0.1]
        .iter()
        .map(|p| p.ln() as f32)
        .collect();
    let params = SamplingParams {
        min_p: 0.6,
        ..Default::default()
    };
    let p = distribution(&logits, &SampleRequest::new(&params, &[], &[], 0)).unwrap();
    assert_close(&p, &[4.0 / 7.0, 3.0 / 7.0, 0.0, 0.0]);
}

#[test]
fn min_p_one_keeps_exact_ties_with_the_maximum() {
    let params = SamplingParams {
        min_p: 1.0,
        ..Default::default()
    };
    let p = distribution(
        &[0.0, 3.0, 3.0, 2.9],
        &SampleRequest::new(&params, &[], &[], 0),
    )
    .unwrap();
    assert_eq!(p, vec![0.0, 0.5, 0.5, 0.0]);
}

#[test]
fn min_p_acts_after_temperature() {
    // At T = 2 the logits [0, -2] give weights [1, e^-1 = 0.368]: min_p 0.3 keeps both;
    // at T = 1 the weights are [1, e^-2 = 0.135]: only token 0.
    let hot = SamplingParams {
        temperature: 2.0,
        min_p: 0.3,
        ..Default::default()
    };
    let p = distribution(&[0.0, -2.0], &SampleRequest::new(&hot, &[], &[], 0)).unwrap();
    assert_close(&p, &softmax(&[0.0, -1.0]));
    let cold = SamplingParams {
        temperature: 1.0,
        ..hot
    };
    let p = distribution(&[0.0, -2.0], &SampleRequest::new(&cold, &[], &[], 0)).unwrap();
    assert_eq!(p, vec![1.0, 0.0]);
}

#[test]
fn min_p_with_top_k_keeps_the_intersection() {
    // Weights at T = 1 relative to the max: [1, e^-0.5, e^-1, e^-3]; min_p 0.3 keeps 3 tokens,
    // top_k 2 keeps 2.
    let params = SamplingParams {
        min_p: 0.3,
        top_k: 2,
        ..Default::default()
    };
    let logits = [0.0f32, -0.5, -1.0, -3.0];
    let p = distribution(&logits, &SampleRequest::new(&params, &[], &[], 0)).unwrap();
    assert_close(
        &p,
        &softmax(&[0.0, -0.5, f64::NEG_INFINITY, f64::NEG_INFINITY]),
    );
    let params = SamplingParams {
        min_p: 0.3,
        top_k: 3,
        top_p: 0.999,
        ..Default::default()
    };
    let p = distribution(&logits, &SampleRequest::new(&params, &[], &[], 0)).unwrap();
    assert_close(&p, &softmax(&[0.0, -0.5, -1.0, f64::NEG_INFINITY]));
}

#[test]
fn logit_bias_is_added_and_clamped_to_100() {
    let params = SamplingParams {
        logit_bias: BTreeMap::from([(0, -1000.0), (2, 1.5)]),
        ..Default::default()
    };
    let p = distribution(
        &[0.0, -50.0, -60.0],
        &SampleRequest::new(&params, &[], &[], 0),
    )
    .unwrap();
    assert_close(&p, &softmax(&[-100.0, -50.0, -58.5]));
    let params = SamplingParams {
        logit_bias: BTreeMap::from([(2, 1e9)]),
        ..SamplingParams::greedy()
    };
    // +100, not +1e9: token 0 at 150 still wins over token 2 at -60 + 100.
    let out = sample_row(
        &[150.0, 0.0, -60.0],
        &SampleRequest::new(&params, &[], &[], 0),
    );
    assert_eq!(out.unwrap().token, 0);
}

#[test]
fn logit_bias_does_not_unmask_a_banned_token() {
    let params = SamplingParams {
        logit_bias: BTreeMap::from([(1, 100.0)]),
        allowed_token_ids: Some(vec![0]),
        ..Default::default()
    };
    let p = distribution(&[0.0, 0.0], &SampleRequest::new(&params, &[], &[], 0)).unwrap();
    assert_eq!(p, vec![1.0, 0.0]);
}

#[test]
fn allowed_token_ids_mask_everything_else() {
    let params = SamplingParams {
        allowed_token_ids: Some(vec![3, 1]),
        ..Default::default()
    };
    let logits = [5.0f32, 1.0, 4.0, 2.0];
    let p = distribution(&logits, &SampleRequest::new(&params, &[], &[], 0)).unwrap();
    let ninf = f64::NEG_INFINITY;
    assert_close(&p, &softmax(&[ninf, 1.0, ninf, 2.0]));
    let greedy = SamplingParams {
        temperature: 0.0,
        ..params
    };
    let out = sample_row(&logits, &SampleRequest::new(&greedy, &[], &[], 0)).unwrap();
    assert_eq!(out.token, 3);
}

#[test]
fn allowed_ids_that_are_all_masked_leave_no_candidates() {
    let params = SamplingParams {
        allowed_token_ids: Some(vec![1]),
        ..Default::default()
    };
    let err = distribution(
        &[0.0, f32::NEG_INFINITY],
        &SampleRequest::new(&params, &[], &[], 0),
    )
    .unwrap_err();
    assert_eq!(err, SampleError::NoCandidates);
}

#[test]
fn bad_words_ban_the_last_token_when_the_prefix_matches() {
    let params = SamplingParams {
        bad_words: vec![vec![3], vec![0, 2], vec![1, 0, 1]],
        ..SamplingParams::greedy()
    };
    let logits = [0.0f32, 1.0, 3.0, 4.0];
    // Output ends with [0]: token 2 banned; token 3 is banned always; [1, 0] does not end it.
    let out = sample_row(&logits, &SampleRequest::new(&params, &[], &[2, 0], 2)).unwrap();
    assert_eq!(out.token, 1);
    // Output ends with [1, 0]: token 1 banned too, token 0 remains.
    let out = sample_row(&logits, &SampleRequest::new(&params, &[], &[1, 0], 2)).unwrap();
    assert_eq!(out.token, 0);
    // Output ends with [2]: only token 3 banned.
    let out = sample_row(&logits, &SampleRequest::new(&params, &[], &[2], 1)).unwrap();
    assert_eq!(out.token, 2);
}

#[test]
fn min_tokens_bans_eos_and_stop_ids_until_reached() {
    let params = SamplingParams {
        min_tokens: 2,
        ..SamplingParams::greedy()
    };
    let logits = [9.0f32, 8.0, 1.0];
    let ends = [0u32, 1];
    let req = |output: &'static [u32]| {
        SampleRequest::new(&params, &[], output, output.len() as u64).with_stop_token_ids(&ends)
    };
    assert_eq!(sample_row(&logits, &req(&[2])).unwrap().token, 2);
    assert_eq!(sample_row(&logits, &req(&[2, 2])).unwrap().token, 0);
}

#[test]
fn out_of_range_new_parameters_are_named() {
    let cases: Vec<(SamplingParams, &str)> = vec![
        (
            SamplingParams {
                min_p: 1.5,
                ..Default::default()
            },
            "min_p",
        ),
        (
            SamplingParams {
                min_p: -0.1,
                ..Default::default()
            },
            "min_p",
        ),
        (
            SamplingParams {
                min_p: f64::NAN,
                ..Default::default()
            },
            "min_p",
        ),
        (
            SamplingParams {
                presence_penalty: 2.5,
                ..Default::default()
            },
            "presence_penalty",
        ),
        (
            SamplingParams {
                frequency_penalty: -3.0,
                ..Default::default()
            },
            "frequency_penalty",
        ),
        (
            SamplingParams {
                frequency_penalty: f64::NAN,
                ..Default::default()
            },
            "frequency_penalty",
        ),
        (
            SamplingParams {
                logit_bias: BTreeMap::from([(0, f64::NAN)]),
                ..Default::default()
            },
            "logit_bias",
        ),
        (
            SamplingParams {
                allowed_token_ids: Some(vec![]),
                ..Default::default()
            },
            "allowed_token_ids",
        ),
        (
            SamplingParams {
                bad_words: vec![vec![]],
                ..Default::default()
            },
            "bad_words",
        ),
    ];
    for (params, field) in cases {
        let err = params.validate().unwrap_err();
        assert_eq!(err.field, field);
        let got = distribution(&[0.0, 1.0], &SampleRequest::new(&params, &[], &[], 0));
        assert!(matches!(got, Err(SampleError::InvalidParams(ref e)) if e.field == field));
    }
}

#[test]
fn ids_outside_the_vocabulary_in_new_parameters_are_errors() {
    let row = [0.0f32, 1.0];
    let check = |params: &SamplingParams, stop: &[u32], field: &str| {
        let req = SampleRequest::new(params, &[], &[], 0).with_stop_token_ids(stop);
        match distribution(&row, &req) {
            Err(SampleError::TokenIdOutOfRange {
                field: f,
                token_id: 2,
                vocab_size: 2,
            }) => assert_eq!(f, field),
            other => panic!("{field}: {other:?}"),
        }
    };
    let bias = SamplingParams {
        logit_bias: BTreeMap::from([(2, 1.0)]),
        ..Default::default()
    };
    check(&bias, &[], "logit_bias");
    let allowed = SamplingParams {
        allowed_token_ids: Some(vec![0, 2]),
        ..Default::default()
    };
    check(&allowed, &[], "allowed_token_ids");
    let bad = SamplingParams {
        bad_words: vec![vec![0, 2]],
        ..Default::default()
    };
    check(&bad, &[], "bad_words");
    check(&SamplingParams::default(), &[2], "stop_token_ids");
}

#[test]
fn the_callers_logits_are_not_modified() {
    let params = SamplingParams {
        repetition_penalty: 1.5,
        frequency_penalty: 1.0,
        presence_penalty: 1.0,
        logit_bias: BTreeMap::from([(0, 5.0)]),
        bad_words: vec![vec![1]],
        allowed_token_ids: Some(vec![0, 1, 2]),
        min_p: 0.1,
        ..Default::default()
    };
    let logits = vec![1.0f32, 2.0, 3.0, 4.0];
    let copy = logits.clone();
    distribution(&logits, &SampleRequest::new(&params, &[0], &[2, 2], 3)).unwrap();
    assert_eq!(logits, copy);
}

mod probability_input {
    //! The spec's probability-input cases, exact where the values are dyadic.

    use super::assert_close;
    use nucleus_sampling::{
        distribution_from_probs, sample_batch, sample_row_from_probs, InputKind, LogitsView,
        SampleError, SampleRequest, SamplingParams,
    };
    use std::collections::BTreeMap;

    const P: [f32; 4] = [0.4, 0.3, 0.2, 0.1];

    fn dist(probs: &[f32], params: &SamplingParams) -> Result<Vec<f64>, SampleError> {
        distribution_from_probs(probs, &SampleRequest::new(params, &[], &[], 0))
    }

    #[test]
    fn spec_top_k_and_top_p_cases() {
        let k2 = SamplingParams {
            top_k: 2,
            ..Default::default()
        };
        assert_close(&dist(&P, &k2).unwrap(), &[4.0 / 7.0, 3.0 / 7.0, 0.0, 0.0]);
        let p08 = SamplingParams {
            top_p: 0.8,
            ..Default::default()
        };
        assert_close(
            &dist(&P, &p08).unwrap(),
            &[4.0 / 9.0, 3.0 / 9.0, 2.0 / 9.0, 0.0],
        );
        let k2p05 = SamplingParams {
            top_k: 2,
            top_p: 0.5,
            ..Default::default()
        };
        assert_eq!(dist(&P, &k2p05).unwrap(), vec![1.0, 0.0, 0.0, 0.0]);
    }

    #[test]
    fn spec_exact_top_p_hit_takes_nothing_more() {
        // [0.25, 0.125, 0.125, 0.5], top_p 0.75: 0.5 + 0.25 reaches 0.75 exactly.
        let params = SamplingParams {
            top_p: 0.75,
            ..Default::default()
        };
        let p = dist(&[0.25, 0.125, 0.125, 0.5], &params).unwrap();
        assert_eq!(p, vec![1.0 / 3.0, 0.0, 0.0, 2.0 / 3.0]);
    }

    #[test]
    fn unnormalised_weights_are_renormalised() {
        let p = dist(&[2.0, 0.0, 6.0], &SamplingParams::default()).unwrap();
        assert_eq!(p, vec![0.25, 0.0, 0.75]);
    }

    #[test]
    fn min_p_on_probabilities_keeps_exact_ties() {
        // 0.2 == 0.5 * 0.4 exactly in binary: kept.
        let params = SamplingParams {
            min_p: 0.5,
            ..Default::default()
        };
        assert_close(
            &dist(&P, &params).unwrap(),
            &[4.0 / 9.0, 3.0 / 9.0, 2.0 / 9.0, 0.0],
        );
    }

    #[test]
    fn greedy_and_masks_on_probabilities() {
        let params = SamplingParams {
            allowed_token_ids: Some(vec![1, 2]),
            ..SamplingParams::greedy()
        };
        let out = sample_row_from_probs(&P, &SampleRequest::new(&params, &[], &[], 0)).unwrap();
        assert_eq!(out.token, 1);
        assert_eq!(out.logprob, 0.0);
    }

    #[test]
    fn logits_only_parameters_are_errors_with_probabilities() {
        let cases = [
            (
                SamplingParams {
                    temperature: 0.5,
                    ..Default::default()
                },
                "temperature",
            ),
            (
                SamplingParams {
                    repetition_penalty: 1.2,
                    ..Default::default()
                },
                "repetition_penalty",
            ),
            (
                SamplingParams {
                    presence_penalty: 0.5,
                    ..Default::default()
                },
                "presence_penalty",
            ),
            (
                SamplingParams {
                    frequency_penalty: 0.5,
                    ..Default::default()
                },
                "frequency_penalty",
            ),
            (
                SamplingParams {
                    logit_bias: BTreeMap::from([(0, 1.0)]),
                    ..Default::default()
                },
                "logit_bias",
            ),
        ];
        for (params, field) in cases {
            match dist(&P, &params) {
                Err(SampleError::InvalidParams(e)) => assert_eq!(e.field, field),
                other => panic!("{field}: {other:?}"),
            }
        }
    }

    #[test]
    fn bad_probability_rows_are_errors_for_that_row_only() {
        let params = SamplingParams {
            seed: Some(3),
            ..Default::default()
        };
        let data = [
            0.5f32,
            -0.1,
            0.5, // negative
            0.0,
            f32::INFINITY,
            1.0, // inf
            0.0,
            0.0,
            0.0, // nothing
            0.0,
            0.0,
            1.0, // healthy
        ];
        let view = LogitsView::dense(&data, 4, 3)
            .unwrap()
            .with_kind(InputKind::Probs);
        let reqs = [SampleRequest::new(&params, &[], &[], 0); 4];
        let out = sample_batch(&view, &reqs).unwrap();
        assert!(matches!(
            out[0],
            Err(SampleError::InvalidProbability { token_id: 1, .. })
        ));
        assert!(matches!(
            out[1],
            Err(SampleError::InvalidProbability { token_id: 1, .. })
        ));
        assert_eq!(out[2], Err(SampleError::NoCandidates));
        assert_eq!(out[3].as_ref().unwrap().token, 2);
    }
}

mod sixteen_bit_input {
    //! f16 and bf16 logits: widened exactly to f32, then the same contract.

    use half::{bf16, f16};
    use nucleus_sampling::{sample_batch, LogitsView, SampleRequest, SamplingParams};

    #[test]
    fn spec_f16_logits_at_tiny_temperature() {
        // f16 logits [10, 9, -5], temperature 1e-4 -> token 0, no NaN.
        let data: Vec<f16> = [10.0f32, 9.0, -5.0].map(f16::from_f32).to_vec();
        let params = SamplingParams {
            temperature: 1e-4,
            seed: Some(9),
            ..Default::default()
        };
        let view = LogitsView::dense(&data, 1, 3).unwrap();
        let out = sample_batch(&view, &[SampleRequest::new(&params, &[], &[], 0)]).unwrap();
        let out = out[0].as_ref().unwrap();
        assert_eq!(out.token, 0);
        assert!(!out.logprob.is_nan());
    }

    #[test]
    fn sixteen_bit_rows_sample_exactly_as_their_f32_values() {
        let vocab = 500;
        let values: Vec<f32> = (0..2 * vocab)
            .map(|i| ((i * 7919 % 1000) as f32 / 100.0) - 5.0)
            .collect();
        let params = SamplingParams {
            temperature: 0.7,
            top_k: 40,
            top_p: 0.9,
            min_p: 0.01,
            seed: Some(5),
            ..Default::default()
        };
        let reqs: Vec<SampleRequest<'_>> = (0..2)
            .map(|r| SampleRequest::new(&params, &[1, 2], &[3], 10 + r))
            .collect();
        let h: Vec<f16> = values.iter().map(|&v| f16::from_f32(v)).collect();
        let b: Vec<bf16> = values.iter().map(|&v| bf16::from_f32(v)).collect();
        let h32: Vec<f32> = h.iter().map(|v| v.to_f32()).collect();
        let b32: Vec<f32> = b.iter().map(|v| v.to_f32()).collect();
        for (sixteen, widened) in [
            (
                sample_batch(&LogitsView::dense(&h, 2, vocab).unwrap(), &reqs).unwrap(),
                sample_batch(&LogitsView::dense(&h32, 2, vocab).unwrap(), &reqs).unwrap(),
            ),
            (
                sample_batch(&LogitsView::dense(&b, 2, vocab).unwrap(), &reqs).unwrap(),
                sample_batch(&LogitsView::dense(&b32, 2, vocab).unwrap(), &reqs).unwrap(),
            ),
        ] {
            assert_eq!(sixteen, widened);
        }
    }

    #[test]
    fn nan_in_an_f16_row_is_an_error_for_that_row_only() {
        let data: Vec<f16> = [1.0f32, f32::NAN, 0.0, 1.0, 2.0, 0.0]
            .map(f16::from_f32)
            .to_vec();
        let params = SamplingParams::greedy();
        let reqs = [SampleRequest::new(&params, &[], &[], 0); 2];
        let out = sample_batch(&LogitsView::dense(&data, 2, 3).unwrap(), &reqs).unwrap();
        assert!(out[0].is_err());
        assert_eq!(out[1].as_ref().unwrap().token, 1);
    }
}
