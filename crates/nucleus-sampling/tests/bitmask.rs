//! The structured-output token bitmask: its layout (XGrammar / llguidance: token `t` is bit
//! `t % 32` of word `t / 32`, LSB first), the in-place kernel, and masking at spec step 3 of
//! sampling (after the row check and the raw logprobs, before bias and penalties), against the
//! f64 oracle run on the row with the masked tokens written as -inf.

mod common;

use common::oracle::oracle_with_stops;
use common::{assert_close, normal_row, SplitMix};
use nucleus_sampling::{
    apply_token_bitmask_inplace, apply_token_bitmask_inplace_batch, bitmask_words, distribution,
    sample_batch, sample_row, BitmaskError, LogitsView, LogprobsKind, ProcessorContext,
    SampleError, SampleRequest, SamplerChain, SamplingParams, TokenBitmask,
};

/// A random mask row for `n` ids: whole words allowed or masked, and mixed words, each token
/// allowed with probability `density`.
fn random_mask(rng: &mut SplitMix, n: usize, density: f64) -> Vec<u32> {
    (0..bitmask_words(n))
        .map(|_| match rng.below(4) {
            0 => u32::MAX,
            1 => 0,
            _ => (0..32).fold(0u32, |w, b| {
                if rng.next_f64() < density {
                    w | 1 << b
                } else {
                    w
                }
            }),
        })
        .collect()
}

fn allowed(mask: &[u32], t: usize) -> bool {
    mask[t / 32] >> (t % 32) & 1 == 1
}

#[test]
fn layout_is_lsb_first_words_of_32() {
    // 70 ids: 3 words. Token 0 is bit 0 of word 0, token 31 bit 31 of word 0, token 32 bit 0
    // of word 1, token 69 bit 5 of word 2.
    let mut m = TokenBitmask::new(2, 70);
    assert_eq!(m.words_per_row(), 3);
    assert_eq!(m.row(0), &[u32::MAX, u32::MAX, 0b11_1111]);
    m.disallow_all(1);
    for t in [0usize, 31, 32, 69] {
        m.set(1, t, true);
    }
    assert_eq!(m.row(1), &[1 | 1 << 31, 1, 1 << 5]);
    assert!(m.is_allowed(1, 69) && !m.is_allowed(1, 68) && !m.is_allowed(1, 70));
    m.set(0, 33, false);
    assert_eq!(m.row(0)[1], !(1u32 << 1));
    m.allow_all(1);
    assert_eq!(m.row(1), &[u32::MAX, u32::MAX, 0b11_1111]);
    assert_eq!(
        TokenBitmask::from_words(vec![0; 5], 2, 70),
        Err(BitmaskError::Shape {
            words: 5,
            batch: 2,
            row_len: 70
        })
    );
    assert!(TokenBitmask::from_words(vec![0; 6], 2, 70).is_ok());
}

#[test]
fn the_kernel_masks_in_place_and_rejects_a_short_row() {
    let mut row: Vec<f32> = (0..40).map(|i| i as f32).collect();
    // Allow 0, 5, 33 only; a third word (a padded row's) is accepted and not read.
    let mask = [1u32 | 1 << 5, 1 << 1, 0];
    apply_token_bitmask_inplace(&mut row, &mask).unwrap();
    for (t, &x) in row.iter().enumerate() {
        if [0, 5, 33].contains(&t) {
            assert_eq!(x, t as f32);
        } else {
            assert_eq!(x, f32::NEG_INFINITY, "token {t}");
        }
    }
    let mut row = vec![1.0f32; 40];
    assert_eq!(
        apply_token_bitmask_inplace(&mut row, &[0]),
        Err(BitmaskError::RowTooShort {
            words: 1,
            needed: 2,
            row_len: 40
        })
    );
    assert!(
        row.iter().all(|&x| x == 1.0),
        "a rejected call changes nothing"
    );
}

#[test]
fn the_batch_kernel_equals_the_row_kernel() {
    let mut rng = SplitMix(11);
    let (batch, n) = (7, 1000);
    let mut mask = TokenBitmask::new(batch, n);
    for i in 0..batch {
        let r = random_mask(&mut rng, n, 0.3);
        mask.row_mut(i).copy_from_slice(&r);
    }
    let logits: Vec<f32> = (0..batch)
        .flat_map(|i| normal_row(i as u64, n, 2.0))
        .collect();
    let mut got = logits.clone();
    apply_token_bitmask_inplace_batch(&mut got, &mask).unwrap();
    for i in 0..batch {
        for t in 0..n {
            let want = if allowed(mask.row(i), t) {
                logits[i * n + t]
            } else {
                f32::NEG_INFINITY
            };
            assert_eq!(got[i * n + t].to_bits(), want.to_bits());
        }
    }
    let mut short = vec![0.0f32; batch * n - 1];
    assert_eq!(
        apply_token_bitmask_inplace_batch(&mut short, &mask),
        Err(BitmaskError::LogitsShape {
            values: batch * n - 1,
            batch,
            row_len: n
        })
    );
}

/// Every parameter family with a random mask equals the oracle on the pre-masked row; the
/// sampled token is always allowed.
#[test]
fn sampling_with_a_mask_equals_the_oracle_on_the_masked_row() {
    let mut rng = SplitMix(5);
    let mut checked = 0;
    for case in 0..400u64 {
        let n = [37usize, 64, 300, 2048][(case % 4) as usize];
        let row = normal_row(case, n, 3.0);
        let mask = random_mask(&mut rng, n, [0.02, 0.3, 0.9][(case % 3) as usize]);
        let prompt: Vec<u32> = (0..5).map(|_| rng.below(n as u64) as u32).collect();
        let output: Vec<u32> = (0..3).map(|_| rng.below(n as u64) as u32).collect();
        let mut params = SamplingParams {
            seed: Some(case),
            ..Default::default()
        };
        match case % 6 {
            0 => params.top_k = 5,
            1 => params.top_p = 0.8,
            2 => params.min_p = 0.1,
            3 => {
                params.repetition_penalty = 1.3;
                params.logit_bias.insert(output[0], 4.0);
            }
            4 => {
                params.temperature = 0.0;
            }
            _ => {
                params.temperature = 0.7;
                params.top_k = 40;
                params.top_p = 0.9;
                params.presence_penalty = 0.5;
            }
        }
        let masked: Vec<f32> = row
            .iter()
            .enumerate()
            .map(|(t, &x)| {
                if allowed(&mask, t) {
                    x
                } else {
                    f32::NEG_INFINITY
                }
            })
            .collect();
        let request = SampleRequest::new(&params, &prompt, &output, 8).with_token_bitmask(&mask);
        let want = oracle_with_stops(&masked, &params, &prompt, &output, &[]);
        let got = distribution(&row, &request);
        match want {
            Err(_) => {
                assert_eq!(got, Err(SampleError::NoCandidates), "case {case}");
                continue;
            }
            Ok(o) if o.fragile => continue,
            Ok(o) => {
                let d = got.unwrap();
                assert_close(&d, &o.probs, 1e-6, &format!("case {case}"));
                let s = sample_row(&row, &request).unwrap();
                assert!(allowed(&mask, s.token as usize), "case {case}: {}", s.token);
                // The fixed chain with the mask in its context agrees.
                let mut chain = SamplerChain::from_params(&params).unwrap();
                let ctx = ProcessorContext::new(&prompt, &output, 8).with_token_bitmask(&mask);
                chain.reset(&prompt);
                for &t in &output {
                    chain.accept(t);
                }
                let dc = chain.distribution(&row, &ctx).unwrap();
                assert_close(&dc, &o.probs, 1e-6, &format!("chain, case {case}"));
                checked += 1;
            }
        }
    }
    assert!(checked > 300, "only {checked} cases checked");
}

#[test]
fn a_mask_that_leaves_nothing_is_an_error_for_that_row_only() {
    let logits = [1.0f32, 2.0, 3.0, /* row 1 */ 1.0, 2.0, 3.0];
    let view = LogitsView::dense(&logits, 2, 3).unwrap();
    let params = SamplingParams::default();
    let none = [0u32];
    let one = [0b100u32];
    let requests = [
        SampleRequest::new(&params, &[], &[], 0).with_token_bitmask(&none),
        SampleRequest::new(&params, &[], &[], 0).with_token_bitmask(&one),
    ];
    let out = sample_batch(&view, &requests).unwrap();
    assert_eq!(out[0], Err(SampleError::NoCandidates));
    assert_eq!(out[1].as_ref().unwrap().token, 2);
    // The mask and allowed_token_ids together leave nothing: an error, never an
    // unconstrained token.
    let params = SamplingParams {
        allowed_token_ids: Some(vec![0, 1]),
        ..Default::default()
    };
    let r = SampleRequest::new(&params, &[], &[], 0).with_token_bitmask(&one);
    assert_eq!(
        sample_row(&logits[..3], &r).unwrap_err(),
        SampleError::NoCandidates
    );
}

#[test]
fn a_short_mask_is_a_typed_error_and_a_padded_one_is_fine() {
    let row = normal_row(3, 100, 1.0);
    let params = SamplingParams::default();
    let short = [u32::MAX; 3];
    let err = sample_row(
        &row,
        &SampleRequest::new(&params, &[], &[], 0).with_token_bitmask(&short),
    )
    .unwrap_err();
    assert_eq!(
        err,
        SampleError::InvalidBitmask(BitmaskError::RowTooShort {
            words: 3,
            needed: 4,
            row_len: 100
        })
    );
    // A mask of a padded 160-id row over a 100-id vocabulary: ids 100.. are not read.
    let mut padded = [0u32; 5];
    padded[1] = 1 << 7; // token 39
    padded[4] = u32::MAX;
    let s = sample_row(
        &row,
        &SampleRequest::new(&params, &[], &[], 0).with_token_bitmask(&padded),
    )
    .unwrap();
    assert_eq!(s.token, 39);
}

/// Step order: the row check (step 1) sees masked ids too; raw logprobs (step 2) are taken
/// before the mask; processed logprobs after it.
#[test]
fn the_mask_comes_after_the_row_check_and_the_raw_logprobs() {
    let mut row = normal_row(9, 64, 1.0);
    row[10] = f32::NAN;
    let mask = [!(1u32 << 10), u32::MAX];
    let params = SamplingParams::default();
    assert!(matches!(
        sample_row(
            &row,
            &SampleRequest::new(&params, &[], &[], 0).with_token_bitmask(&mask)
        ),
        Err(SampleError::NonFiniteLogits { token_id: 10, .. })
    ));
    row[10] = 5.0; // the best token, masked
    let raw = SamplingParams {
        logprobs: Some(3),
        logprobs_kind: LogprobsKind::Raw,
        seed: Some(1),
        ..Default::default()
    };
    let with = sample_row(
        &row,
        &SampleRequest::new(&raw, &[], &[], 0).with_token_bitmask(&mask),
    )
    .unwrap();
    let without = sample_row(&row, &SampleRequest::new(&raw, &[], &[], 0)).unwrap();
    assert_ne!(with.token, 10);
    let top = |o: &nucleus_sampling::SampleOutput| o.logprobs.as_ref().unwrap().top.clone();
    assert_eq!(top(&with), top(&without), "raw logprobs ignore the mask");
    assert_eq!(top(&with)[0].token_id, 10);
    let processed = SamplingParams {
        logprobs_kind: LogprobsKind::Processed,
        ..raw
    };
    let p = sample_row(
        &row,
        &SampleRequest::new(&processed, &[], &[], 0).with_token_bitmask(&mask),
    )
    .unwrap();
    let entries = top(&p);
    assert!(entries
        .iter()
        .all(|e| e.token_id != 10 || e.logprob == f64::NEG_INFINITY));
}
