//! Regression tests, each named after what broke.

use nucleus_sampling::{
    distribution, distribution_from_probs, sample_batch, sample_row, sample_row_from_probs,
    LogitsView, SampleError, SampleRequest, SamplingParams,
};

#[test]
fn tiny_repetition_penalty_overflowing_a_logit_is_an_error_not_nan() {
    let params = SamplingParams {
        repetition_penalty: 1e-39,
        seed: Some(1),
        ..Default::default()
    };
    let healthy = SamplingParams {
        seed: Some(1),
        ..Default::default()
    };
    let logits = [2.0f32, 1.0, -1.0, 0.5, /* row 1 */ 2.0, 1.0, -1.0, 0.5];
    let view = LogitsView::dense(&logits, 2, 4).unwrap();
    let prompt = [0u32, 1, 2];
    let out = sample_batch(
        &view,
        &[
            SampleRequest::new(&params, &prompt, &[], 3),
            SampleRequest::new(&healthy, &prompt, &[], 3),
        ],
    )
    .unwrap();
    assert_eq!(
        out[0],
        Err(SampleError::PenaltyOverflow {
            token_id: 0,
            logit: 2.0,
            penalty: 1e-39
        })
    );
    assert!(out[1].as_ref().unwrap().logprob.is_finite());
}

#[test]
fn repetition_penalty_rounding_to_zero_keeps_a_removed_token_removed() {
    // 1e-46 is 0 in f32: -0.5 * 0 = -0, and the removed token 1 (-inf) stays -inf instead of
    // -inf * 0 = NaN. Expected: the softmax of [1, -inf, 0], by hand.
    let params = SamplingParams {
        repetition_penalty: 1e-46,
        ..Default::default()
    };
    let row = [1.0f32, f32::NEG_INFINITY, -0.5];
    let e = std::f64::consts::E;
    let want = [e / (e + 1.0), 0.0, 1.0 / (e + 1.0)];
    let got = distribution(&row, &SampleRequest::new(&params, &[1, 2], &[], 2)).unwrap();
    for (g, w) in got.iter().zip(want) {
        assert!((g - w).abs() < 1e-6, "{got:?}");
    }
    // The chain's processor: the same.
    use nucleus_sampling::chain::{LogitsProcessor, ProcessorContext, RepetitionPenalty};
    let mut p = RepetitionPenalty::new(1e-46).unwrap();
    p.reset(&[1, 2]);
    let mut l = row;
    p.apply(&mut l, &ProcessorContext::default()).unwrap();
    assert_eq!(l[1], f32::NEG_INFINITY);
    assert_eq!((l[0], l[2]), (1.0, 0.0));
}

#[test]
fn huge_repetition_penalty_on_a_zero_logit_is_an_error_not_nan() {
    // r = 1e300 is inf in f32 and 0 * inf is NaN.
    let params = SamplingParams {
        repetition_penalty: 1e300,
        ..Default::default()
    };
    let err = distribution(&[0.0, 1.0], &SampleRequest::new(&params, &[0], &[], 1)).unwrap_err();
    assert!(
        matches!(err, SampleError::PenaltyOverflow { token_id: 0, .. }),
        "{err:?}"
    );
}

#[test]
fn temperature_beyond_f32_range_keeps_masked_tokens_at_zero() {
    // T = 1e300 is inf in f32; -inf / inf was NaN. Every finite logit is equally likely.
    let params = SamplingParams {
        temperature: 1e300,
        ..Default::default()
    };
    let p = distribution(
        &[0.0, 1.0, f32::NEG_INFINITY],
        &SampleRequest::new(&params, &[], &[], 0),
    )
    .unwrap();
    assert_eq!(p, vec![0.5, 0.5, 0.0]);
}

#[test]
fn logits_near_f32_max_do_not_overflow_the_max_subtraction() {
    // (l - max) = -2 * f32::MAX overflows f32; in exact arithmetic it is -6.8e38, and at
    // T = 1e38 the weight is exp(-6.8...) relative to the maximum.
    let params = SamplingParams {
        temperature: 1e38,
        ..Default::default()
    };
    let p = distribution(
        &[f32::MAX, -f32::MAX],
        &SampleRequest::new(&params, &[], &[], 0),
    )
    .unwrap();
    let d = (-2.0 * f64::from(f32::MAX)) / 1e38;
    let w = d.exp();
    let expected = [1.0 / (1.0 + w), w / (1.0 + w)];
    for (got, want) in p.iter().zip(expected) {
        assert!((got - want).abs() < 1e-6, "{p:?} vs {expected:?}");
    }
}

#[test]
fn raw_logprobs_keep_their_precision_for_huge_logits() {
    // Found by a new-user test: `l - (max + ln sum)` in f64 lost the ln 2 next to 1e16.
    for (m, n) in [(1e8f32, 2usize), (1e16, 2), (3e38, 3)] {
        let row = vec![m; n];
        let params = SamplingParams {
            seed: Some(1),
            logprobs: Some(n),
            logprobs_kind: nucleus_sampling::LogprobsKind::Raw,
            ..Default::default()
        };
        let out = sample_row(&row, &SampleRequest::new(&params, &[], &[], 0)).unwrap();
        let want = -(n as f64).ln();
        let lp = out.logprobs.unwrap();
        assert!(
            (lp.sampled[0] - want).abs() < 1e-12,
            "{m}: {:?}",
            lp.sampled
        );
        for t in &lp.top {
            assert!((t.logprob - want).abs() < 1e-12, "{m}: {:?}", lp.top);
        }
    }
}

#[test]
fn a_negative_zero_probability_is_a_zero_in_the_distribution() {
    let params = SamplingParams::default();
    let d =
        distribution_from_probs(&[-0.0, 1.0], &SampleRequest::new(&params, &[], &[], 0)).unwrap();
    assert_eq!(d[0].to_bits(), 0.0f64.to_bits());
    assert_eq!(d[1], 1.0);
}

#[test]
fn no_candidates_says_why_for_probabilities_and_masks() {
    let params = SamplingParams::default();
    let err =
        sample_row_from_probs(&[0.0, 0.0], &SampleRequest::new(&params, &[], &[], 0)).unwrap_err();
    assert_eq!(err, SampleError::NoCandidates);
    let msg = err.to_string();
    assert!(
        msg.contains("probability 0") && msg.contains("min_tokens"),
        "{msg}"
    );
}

/// Top-p alone where the best token holds at least `p` of the mass takes a shortcut (no
/// candidate pass): it must still keep exactly the lowest id holding the maximum, with ties,
/// with -0.0 tying +0.0, with the maximum in a row's tail, and must not fire when the best
/// token falls just short.
#[test]
fn top_p_keeps_only_the_lowest_id_of_a_dominant_maximum() {
    let only = |row: &[f32], p: f64| -> Vec<usize> {
        let params = SamplingParams {
            top_p: p,
            seed: Some(7),
            ..Default::default()
        };
        let d = distribution(row, &SampleRequest::new(&params, &[], &[], 0)).unwrap();
        d.iter()
            .enumerate()
            .filter(|&(_, &x)| x > 0.0)
            .map(|(i, _)| i)
            .collect()
    };
    // Two tokens tie at the maximum among 1,000 (weights 1, 1, e^-15 ...): z ~ 2, so p = 0.4
    // is reached by the first of them alone; p = 0.6 needs both.
    let mut row: Vec<f32> = (0..1000).map(|i| -5.0 - (i % 7) as f32).collect();
    row[700] = 10.0;
    row[300] = 10.0;
    assert_eq!(only(&row, 0.4), vec![300]);
    assert_eq!(only(&row, 0.6), vec![300, 700]);
    // -0.0 and +0.0 are one value: the lower id wins whichever sign it has.
    let mut row = vec![-30.0f32; 200];
    row[150] = 0.0;
    row[90] = -0.0;
    assert_eq!(only(&row, 0.4), vec![90]);
    let d = distribution(
        &row,
        &SampleRequest::new(
            &SamplingParams {
                top_p: 0.4,
                ..Default::default()
            },
            &[],
            &[],
            0,
        ),
    )
    .unwrap();
    assert_eq!(d[90], 1.0);
    // The maximum past the last whole run of 64 values.
    let mut row = vec![-40.0f32; 70];
    row[66] = 3.0;
    assert_eq!(only(&row, 0.9), vec![66]);
    // The best token holds 1 / (1 + 3 e^-1) = 0.475: p = 0.47 keeps it alone, p = 0.48 does not.
    let mut row = vec![-100.0f32; 300];
    row[5] = 1.0;
    row[250] = 0.0;
    row[251] = 0.0;
    row[252] = 0.0;
    assert_eq!(only(&row, 0.47), vec![5]);
    assert_eq!(only(&row, 0.48), vec![5, 250]);
}

/// Top-p on a probability row of subnormal values (10,000 of 1e-40, then 10,000 of 5e-41):
/// the dense search (taken for every probability row) once floored its bracket at
/// f32::MIN_POSITIVE, above every value, then at the largest value, and so dropped every
/// 5e-41 that top-p 0.91234 needs. The survivors are the 1e-40 ids and the first `j` of the
/// others, `j` the least count that reaches 0.91234 of the mass.
#[test]
fn top_p_over_tiny_probabilities_keeps_the_whole_prefix() {
    let (a, b) = (1e-40f32, 5e-41f32);
    let row: Vec<f32> = (0..20_000)
        .map(|i| if i < 10_000 { a } else { b })
        .collect();
    let params = SamplingParams {
        top_p: 0.912_34,
        seed: Some(1),
        ..Default::default()
    };
    let d = distribution_from_probs(&row, &SampleRequest::new(&params, &[], &[], 0)).unwrap();
    let (a, b) = (f64::from(a), f64::from(b));
    let target = 0.912_34 * 10_000.0 * (a + b);
    let j = ((target - 10_000.0 * a) / b).ceil() as usize;
    // Clear of a tie with the boundary.
    assert!((10_000.0 * a + j as f64 * b - target) / target > 1e-6);
    let z = 10_000.0 * a + j as f64 * b;
    for (i, &x) in d.iter().enumerate() {
        let want = if i < 10_000 {
            a / z
        } else if i < 10_000 + j {
            b / z
        } else {
            0.0
        };
        assert!(
            (x - want).abs() <= 1e-9 * want.max(1e-12),
            "id {i}: {x}, want {want}"
        );
    }
}
