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
