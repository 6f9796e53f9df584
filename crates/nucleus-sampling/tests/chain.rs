//! Processor chains (`nucleus_sampling::chain`): each processor alone on hand-worked cases from
//! spec/sampling.md, the order of processors, the fixed chain against the fast path, cloned
//! state, a user-defined processor, and the JSON configuration.
//!
//! Expected values are worked by hand from the spec (or come from the f64 oracle in
//! `common/oracle.rs`), never from the implementation, except in the one equivalence test
//! (`fixed_chain_equals_the_fast_path_on_random_rows`), whose point is the equivalence.

mod common;

use std::collections::BTreeMap;

use common::oracle::{oracle, oracle_with_stops, OracleError};
use common::{assert_close, inverse_cdf, ln_row, spec_uniform, SplitMix};
use nucleus_sampling::chain::{
    AllowedTokenIds, BadWords, ChainError, FrequencyPresencePenalty, LogitBias, LogitsProcessor,
    MinP, MinTokens, ProcessorConfig, ProcessorContext, RepetitionPenalty, SamplerChain, Selection,
    Temperature, TopK, TopP,
};
use nucleus_sampling::{
    distribution, sample_row, LogprobsKind, SampleError, SampleRequest, SamplingParams,
};

const NEG: f32 = f32::NEG_INFINITY;

fn ctx0() -> ProcessorContext<'static> {
    ProcessorContext::default()
}

/// A sampling chain with these processors and seed 1.
fn chain_of(processors: Vec<Box<dyn LogitsProcessor>>) -> SamplerChain {
    let mut chain = SamplerChain::new(Selection::sample(Some(1)));
    for p in processors {
        chain.push_boxed(p);
    }
    chain
}

/// The chain's final distribution on `logits` with an empty context.
fn dist(processors: Vec<Box<dyn LogitsProcessor>>, logits: &[f32]) -> Vec<f64> {
    chain_of(processors).distribution(logits, &ctx0()).unwrap()
}

/// Applies one processor alone to a copy of `logits`.
fn applied(p: &mut dyn LogitsProcessor, logits: &[f32], ctx: &ProcessorContext<'_>) -> Vec<f32> {
    let mut row = logits.to_vec();
    p.apply(&mut row, ctx).unwrap();
    row
}

fn support(probs: &[f64]) -> Vec<u32> {
    (0..probs.len() as u32)
        .filter(|&i| probs[i as usize] > 0.0)
        .collect()
}

// ---------------------------------------------------------------------------------------------
// (1) Each processor alone, on hand-worked cases
// ---------------------------------------------------------------------------------------------

#[test]
fn top_k_alone_keeps_exactly_k_with_ties_to_the_lower_id() {
    // spec worked case: probs [0.4, 0.3, 0.2, 0.1], top_k 2 -> [4/7, 3/7, 0, 0].
    let row = ln_row(&[0.4, 0.3, 0.2, 0.1]);
    let d = dist(vec![Box::new(TopK::new(2).unwrap())], &row);
    assert_close(&d, &[4.0 / 7.0, 3.0 / 7.0, 0.0, 0.0], 1e-6, "top_k 2");

    // spec worked case: logits [1, 2, 2, 2, 3], top_k 3 -> {4, 1, 2}.
    let row = [1.0f32, 2.0, 2.0, 2.0, 3.0];
    let out = applied(&mut TopK::new(3).unwrap(), &row, &ctx0());
    assert_eq!(out, [NEG, 2.0, 2.0, NEG, 3.0]);

    // top_k 1 is greedy: [5, 5, 1] keeps token 0 only.
    let out = applied(&mut TopK::new(1).unwrap(), &[5.0, 5.0, 1.0], &ctx0());
    assert_eq!(out, [5.0, NEG, NEG]);

    // 0, -1 and k >= vocab are off; -2 is an error.
    for k in [0, -1, 5, 6, 1000] {
        let out = applied(&mut TopK::new(k).unwrap(), &row, &ctx0());
        assert_eq!(out, row, "top_k {k} is off");
    }
    assert_eq!(TopK::new(-2).unwrap_err().field, "top_k");

    // Fewer finite logits than k: unchanged.
    let masked = [NEG, 1.0, NEG, 0.0];
    assert_eq!(
        applied(&mut TopK::new(3).unwrap(), &masked, &ctx0()),
        masked
    );
}

#[test]
fn top_p_alone_keeps_the_smallest_prefix_reaching_p() {
    // spec worked case: probs [0.4, 0.3, 0.2, 0.1], top_p 0.8 -> [4/9, 3/9, 2/9, 0]
    // (0.4 + 0.3 = 0.7 < 0.8 <= 0.9).
    let row = ln_row(&[0.4, 0.3, 0.2, 0.1]);
    let d = dist(vec![Box::new(TopP::new(0.8).unwrap())], &row);
    assert_close(
        &d,
        &[4.0 / 9.0, 3.0 / 9.0, 2.0 / 9.0, 0.0],
        1e-6,
        "top_p 0.8",
    );

    // probs [0.25, 0.125, 0.125, 0.5], top_p 0.7: 0.5 < 0.7 <= 0.75 -> {3, 0} = [1/3, 0, 0, 2/3].
    let row = ln_row(&[0.25, 0.125, 0.125, 0.5]);
    let d = dist(vec![Box::new(TopP::new(0.7).unwrap())], &row);
    assert_close(&d, &[1.0 / 3.0, 0.0, 0.0, 2.0 / 3.0], 1e-6, "top_p 0.7");

    // Ties toward the lower id: probs [0.3, 0.3, 0.4], top_p 0.6: 0.4, then id 0 (0.7 >= 0.6).
    let row = ln_row(&[0.3, 0.3, 0.4]);
    let d = dist(vec![Box::new(TopP::new(0.6).unwrap())], &row);
    assert_close(&d, &[3.0 / 7.0, 0.0, 4.0 / 7.0], 1e-6, "top_p tie");

    // A tiny p keeps the most likely token only; 1 is off.
    let d = dist(
        vec![Box::new(TopP::new(1e-9).unwrap())],
        &ln_row(&[0.2, 0.5, 0.3]),
    );
    assert_close(&d, &[0.0, 1.0, 0.0], 0.0, "top_p tiny");
    let row = [0.5f32, -1.0, NEG, 2.0];
    assert_eq!(applied(&mut TopP::new(1.0).unwrap(), &row, &ctx0()), row);

    for bad in [0.0, -0.5, 1.5, f64::NAN] {
        assert_eq!(TopP::new(bad).unwrap_err().field, "top_p", "{bad}");
    }
}

#[test]
fn min_p_alone_keeps_tokens_at_or_above_min_p_times_p_max() {
    // probs [0.5, 0.25, 0.2, 0.05], min_p 0.45: threshold 0.225 -> {0, 1} = [2/3, 1/3, 0, 0].
    let row = ln_row(&[0.5, 0.25, 0.2, 0.05]);
    let d = dist(vec![Box::new(MinP::new(0.45).unwrap())], &row);
    assert_close(&d, &[2.0 / 3.0, 1.0 / 3.0, 0.0, 0.0], 1e-6, "min_p 0.45");

    // Ties with the threshold are kept: logits [1, 1, 0], min_p 1 -> [1/2, 1/2, 0].
    let d = dist(vec![Box::new(MinP::new(1.0).unwrap())], &[1.0, 1.0, 0.0]);
    assert_eq!(d, [0.5, 0.5, 0.0]);

    // 0 is off.
    let row = [0.5f32, -30.0, NEG];
    assert_eq!(applied(&mut MinP::new(0.0).unwrap(), &row, &ctx0()), row);
    for bad in [-0.1, 1.1, f64::NAN] {
        assert_eq!(MinP::new(bad).unwrap_err().field, "min_p", "{bad}");
    }
}

#[test]
fn temperature_alone_is_a_pure_division() {
    // logits [1, 2, 3, -inf], T 0.5 -> [2, 4, 6, -inf] (Hugging Face's `scores / temperature`).
    let out = applied(
        &mut Temperature::new(0.5).unwrap(),
        &[1.0, 2.0, 3.0, NEG],
        &ctx0(),
    );
    assert_eq!(out, [2.0, 4.0, 6.0, NEG]);
    // Negative logits stay negative, positive stay positive: T 2 on [-3, 0, 5].
    let out = applied(
        &mut Temperature::new(2.0).unwrap(),
        &[-3.0, 0.0, 5.0],
        &ctx0(),
    );
    assert_eq!(out, [-1.5, 0.0, 2.5]);
    let d = dist(
        vec![Box::new(Temperature::new(0.5).unwrap())],
        &[1.0, 2.0, 3.0, NEG],
    );
    let z = 1.0 + (-2.0f64).exp() + (-4.0f64).exp();
    assert_close(
        &d,
        &[(-4.0f64).exp() / z, (-2.0f64).exp() / z, 1.0 / z, 0.0],
        1e-6,
        "T 0.5",
    );

    // spec worked case: logits [10, 9, -5], temperature 1e-4 -> token 0, no NaN.
    let mut chain = chain_of(vec![Box::new(Temperature::new(1e-4).unwrap())]);
    let d = chain.distribution(&[10.0, 9.0, -5.0], &ctx0()).unwrap();
    assert_eq!(d, [1.0, 0.0, 0.0]);
    assert_eq!(
        chain.sample(&[10.0, 9.0, -5.0], &ctx0(), 0).unwrap().token,
        0
    );

    // A quotient beyond the f32 range is a typed error naming the processor and the lowest
    // such id, never an inf: 1e34 / 1e-5 = 1e39 > f32::MAX (3.4e38); 1e33 / 1e-5 fits.
    let mut chain = chain_of(vec![Box::new(Temperature::new(1e-5).unwrap())]);
    assert_eq!(
        chain
            .distribution(&[0.0, -1e34, 1e34], &ctx0())
            .unwrap_err(),
        SampleError::ProcessorOverflow {
            processor: "temperature",
            token_id: 1,
            logit: -1e34
        }
    );
    let out = applied(&mut Temperature::new(1e-5).unwrap(), &[1e33, 0.0], &ctx0());
    assert!(out.iter().all(|l| l.is_finite()), "{out:?}");

    // Below 1e-5 (use the greedy selection), negative, NaN or infinite: an error.
    for bad in [0.0, 9e-6, -1.0, f64::NAN, f64::INFINITY] {
        assert_eq!(
            Temperature::new(bad).unwrap_err().field,
            "temperature",
            "{bad}"
        );
    }
}

#[test]
fn logit_bias_alone_is_added_and_clamped_to_100() {
    let bias: BTreeMap<u32, f64> = [(1u32, 1e6), (2, -0.5), (3, -250.0)].into_iter().collect();
    let out = applied(
        &mut LogitBias::new(bias).unwrap(),
        &[0.0, 0.0, 0.0, 1.0, NEG],
        &ctx0(),
    );
    assert_eq!(out, [0.0, 100.0, -0.5, -99.0, NEG]);

    for bad in [f64::NAN, f64::INFINITY, f64::NEG_INFINITY] {
        let bias: BTreeMap<u32, f64> = [(0u32, bad)].into_iter().collect();
        assert_eq!(LogitBias::new(bias).unwrap_err().field, "logit_bias");
    }
}

#[test]
fn hard_constraints_alone_set_minus_infinity() {
    let row = [1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0];
    // allowed_token_ids: every other id is -inf (order and duplicates do not matter).
    let mut allowed = AllowedTokenIds::new(vec![4, 0, 4]).unwrap();
    assert_eq!(
        applied(&mut allowed, &row, &ctx0()),
        [1.0, NEG, NEG, NEG, 5.0, NEG]
    );
    assert_eq!(
        AllowedTokenIds::new(vec![]).unwrap_err().field,
        "allowed_token_ids"
    );

    // bad_words: [1, 2] bans 2 after an output ending in 1; [3] is always banned.
    let mut bad = BadWords::new(vec![vec![1, 2], vec![3]]).unwrap();
    let ending_in_1 = ProcessorContext::new(&[], &[5, 1], 2);
    assert_eq!(
        applied(&mut bad, &row, &ending_in_1),
        [1.0, 2.0, NEG, NEG, 5.0, 6.0]
    );
    let ending_in_5 = ProcessorContext::new(&[], &[1, 5], 2);
    assert_eq!(
        applied(&mut bad, &row, &ending_in_5),
        [1.0, 2.0, 3.0, NEG, 5.0, 6.0]
    );
    assert_eq!(
        BadWords::new(vec![vec![1], vec![]]).unwrap_err().field,
        "bad_words"
    );

    // min_tokens 2: the stop ids are banned while fewer than 2 tokens were generated.
    let mut min = MinTokens::new(2);
    let stops = [5u32, 0];
    let one = ProcessorContext::new(&[], &[3], 1).with_stop_token_ids(&stops);
    assert_eq!(
        applied(&mut min, &row, &one),
        [NEG, 2.0, 3.0, 4.0, 5.0, NEG]
    );
    let two = ProcessorContext::new(&[], &[3, 3], 2).with_stop_token_ids(&stops);
    assert_eq!(applied(&mut min, &row, &two), row);
}

#[test]
fn repetition_penalty_worked_case() {
    // spec worked case: logits [2, -1, 0.5], seen ids {0, 1} (id 1 seen twice), repetition 2.0
    // -> [1, -2, 0.5].
    let mut p = RepetitionPenalty::new(2.0).unwrap();
    p.reset(&[0]);
    p.accept(1);
    p.accept(1);
    // The context's ids are not read: the state comes from reset / accept.
    assert_eq!(
        applied(&mut p, &[2.0, -1.0, 0.5], &ctx0()),
        [1.0, -2.0, 0.5]
    );
    assert_eq!(p.seen_ids(), [0, 1]);

    for bad in [0.0, -1.0, f64::NAN, f64::INFINITY] {
        assert_eq!(
            RepetitionPenalty::new(bad).unwrap_err().field,
            "repetition_penalty"
        );
    }
}

#[test]
fn penalties_worked_case() {
    // spec worked case: logits [1, 1, 1], prompt [2], generated [0, 0, 1], repetition 2,
    // frequency 0.5, presence 0.5 -> [-1, -0.5, 0.5].
    // Repetition: every id is seen -> 0.5 each. Then id 0 (twice): 0.5 - (2 * 0.5 + 0.5) = -1;
    // id 1 (once): 0.5 - (0.5 + 0.5) = -0.5; id 2 is in the prompt only: 0.5.
    let want = [-1.0f32, -0.5, 0.5];
    let combined: Vec<Box<dyn LogitsProcessor>> = vec![
        Box::new(RepetitionPenalty::new(2.0).unwrap()),
        Box::new(FrequencyPresencePenalty::new(0.5, 0.5).unwrap()),
    ];
    let separate: Vec<Box<dyn LogitsProcessor>> = vec![
        Box::new(RepetitionPenalty::new(2.0).unwrap()),
        Box::new(FrequencyPresencePenalty::frequency(0.5).unwrap()),
        Box::new(FrequencyPresencePenalty::presence(0.5).unwrap()),
    ];
    for processors in [combined, separate] {
        let mut chain = chain_of(processors);
        chain.reset(&[2]);
        for t in [0, 0, 1] {
            chain.accept(t);
        }
        let out = chain.process(&[1.0, 1.0, 1.0], &ctx0()).unwrap();
        assert_eq!(out, want);
    }
    assert_eq!(
        FrequencyPresencePenalty::new(2.5, 0.0).unwrap_err().field,
        "frequency_penalty"
    );
    assert_eq!(
        FrequencyPresencePenalty::presence(-2.1).unwrap_err().field,
        "presence_penalty"
    );
    // reset clears the counts (prompt ids never count for frequency / presence).
    let mut fp = FrequencyPresencePenalty::new(1.0, 0.0).unwrap();
    fp.accept(1);
    fp.reset(&[1, 1]);
    assert_eq!(fp.count(1), 0);
    assert_eq!(applied(&mut fp, &[0.0, 0.0], &ctx0()), [0.0, 0.0]);
}

#[test]
fn greedy_selection_takes_the_argmax_ties_to_the_lowest_id() {
    // spec worked case: logits [5, 5, 1], temperature 0 -> token 0; top_k 1 -> token 0 always.
    let mut greedy = SamplerChain::new(Selection::greedy());
    let out = greedy.sample(&[5.0, 5.0, 1.0], &ctx0(), 0).unwrap();
    assert_eq!((out.token, out.logprob, out.num_candidates), (0, 0.0, 1));
    assert_eq!(
        greedy.distribution(&[5.0, 5.0, 1.0], &ctx0()).unwrap(),
        [1.0, 0.0, 0.0]
    );
    let mut k1 = chain_of(vec![Box::new(TopK::new(1).unwrap())]);
    for seed in 0..50u64 {
        k1.set_selection(Selection::sample(Some(seed)));
        let ctx = ProcessorContext::new(&[], &[], seed * 7);
        assert_eq!(k1.sample(&[5.0, 5.0, 1.0], &ctx, 0).unwrap().token, 0);
    }
}

#[test]
fn sample_selection_is_the_inverse_cdf_of_the_spec_stream() {
    // Final probabilities [4/7, 3/7, 0, 0] (top_k 2 on probs [0.4, 0.3, 0.2, 0.1]); the token
    // is the spec's inverse CDF in id order at u = uniform(seed, position, sample_index + j).
    let row = ln_row(&[0.4, 0.3, 0.2, 0.1]);
    let probs = [4.0 / 7.0, 3.0 / 7.0, 0.0, 0.0];
    let prompt = [1u32, 2, 3];
    for seed in [0u64, 1, 42, u64::MAX] {
        let mut chain = SamplerChain::new(Selection::Sample {
            seed: Some(seed),
            n: 3,
            logprobs: None,
            logprobs_kind: LogprobsKind::Processed,
        })
        .with(TopK::new(2).unwrap());
        let ctx = ProcessorContext::new(&prompt, &[], 17);
        let out = chain.sample(&row, &ctx, 5).unwrap();
        assert_eq!(out.seed, seed);
        assert_eq!(out.num_candidates, 2);
        let tokens: Vec<u32> = out.tokens().collect();
        assert_eq!(tokens.len(), 3);
        for (j, &t) in tokens.iter().enumerate() {
            let u = spec_uniform(seed, 17, 5 + j as u32);
            if let Some(want) = inverse_cdf(&probs, u, 1e-6) {
                assert_eq!(t, want, "seed {seed}, sample {j}");
            }
        }
        assert!((out.logprob - probs[out.token as usize].ln()).abs() <= 1e-6);
    }
    // No seed: one is drawn from the OS and reported.
    let mut chain = SamplerChain::new(Selection::sample(None));
    let out = chain.sample(&row, &ctx0(), 0).unwrap();
    let again = SamplerChain::new(Selection::sample(Some(out.seed)))
        .sample(&row, &ctx0(), 0)
        .unwrap();
    assert_eq!(out.token, again.token);
}

#[test]
fn logprobs_processed_and_raw_are_filled_as_the_spec_says() {
    // top_k 2 on probs [0.4, 0.3, 0.2, 0.1]: processed top 4 = ln 4/7, ln 3/7, then -inf for the
    // lowest remaining ids; raw = log_softmax of the row as given (ln p).
    let row = ln_row(&[0.4, 0.3, 0.2, 0.1]);
    for kind in [LogprobsKind::Processed, LogprobsKind::Raw] {
        let mut chain = SamplerChain::new(Selection::Sample {
            seed: Some(9),
            n: 2,
            logprobs: Some(4),
            logprobs_kind: kind,
        })
        .with(TopK::new(2).unwrap());
        let out = chain.sample(&row, &ctx0(), 0).unwrap();
        let lp = out.logprobs.as_ref().expect("asked for");
        assert_eq!(lp.kind, kind);
        let want: [f64; 4] = match kind {
            LogprobsKind::Processed => [
                (4.0f64 / 7.0).ln(),
                (3.0f64 / 7.0).ln(),
                f64::NEG_INFINITY,
                f64::NEG_INFINITY,
            ],
            LogprobsKind::Raw => [0.4f64.ln(), 0.3f64.ln(), 0.2f64.ln(), 0.1f64.ln()],
        };
        let ids: Vec<u32> = lp.top.iter().map(|t| t.token_id).collect();
        assert_eq!(ids, [0, 1, 2, 3]);
        for (t, w) in lp.top.iter().zip(want) {
            assert!(
                t.logprob == w || (t.logprob - w).abs() <= 1e-6,
                "{kind:?}: {t:?} vs {w}"
            );
        }
        assert_eq!(lp.sampled.len(), 2);
        for (s, t) in lp.sampled.iter().zip(out.tokens()) {
            assert!((s - want[t as usize]).abs() <= 1e-6);
        }
    }
    // Greedy: processed is one-hot (0 for the token), padded with -inf.
    let mut greedy = SamplerChain::new(Selection::Greedy {
        n: 1,
        logprobs: Some(2),
        logprobs_kind: LogprobsKind::Processed,
    });
    let lp = greedy
        .sample(&[0.0, 3.0, 1.0], &ctx0(), 0)
        .unwrap()
        .logprobs
        .unwrap();
    assert_eq!(lp.top[0].token_id, 1);
    assert_eq!(lp.top[0].logprob, 0.0);
    assert_eq!(lp.top[1].token_id, 0);
    assert_eq!(lp.top[1].logprob, f64::NEG_INFINITY);
    // More than vocab_size: a parameter error.
    let mut too_many = SamplerChain::new(Selection::Sample {
        seed: Some(1),
        n: 1,
        logprobs: Some(4),
        logprobs_kind: LogprobsKind::Raw,
    });
    match too_many.sample(&[0.0, 1.0, 2.0], &ctx0(), 0) {
        Err(SampleError::InvalidParams(e)) => assert_eq!(e.field, "logprobs"),
        other => panic!("{other:?}"),
    }
}

#[test]
fn row_checks_come_first_and_the_callers_logits_are_not_modified() {
    let mut chain = chain_of(vec![
        Box::new(Temperature::new(0.5).unwrap()),
        Box::new(TopK::new(1).unwrap()),
    ]);
    // NaN / +inf: the lowest such id.
    let row = [0.0f32, 1.0, f32::INFINITY, f32::NAN];
    assert!(matches!(
        chain.sample(&row, &ctx0(), 0),
        Err(SampleError::NonFiniteLogits { token_id: 2, .. })
    ));
    // Everything -inf after processing (here: allowed ids are all masked).
    let mut masked = chain_of(vec![Box::new(AllowedTokenIds::new(vec![0, 2]).unwrap())]);
    assert_eq!(
        masked.sample(&[NEG, 1.0, NEG], &ctx0(), 0),
        Err(SampleError::NoCandidates)
    );
    assert_eq!(
        masked.distribution(&[NEG, 1.0, NEG], &ctx0()),
        Err(SampleError::NoCandidates)
    );
    assert_eq!(
        chain.sample(&[], &ctx0(), 0),
        Err(SampleError::NoCandidates)
    );
    // Ids at or above vocab_size, in the configuration or in the context.
    let mut allowed = chain_of(vec![Box::new(AllowedTokenIds::new(vec![0, 3]).unwrap())]);
    assert_eq!(
        allowed.sample(&[0.0, 1.0, 2.0], &ctx0(), 0),
        Err(SampleError::TokenIdOutOfRange {
            field: "allowed_token_ids",
            token_id: 3,
            vocab_size: 3
        })
    );
    let prompt = [1u32, 7];
    assert_eq!(
        chain.sample(&[0.0, 1.0, 2.0], &ProcessorContext::new(&prompt, &[], 2), 0),
        Err(SampleError::TokenIdOutOfRange {
            field: "prompt_ids",
            token_id: 7,
            vocab_size: 3
        })
    );
    let mut rep = chain_of(vec![Box::new(RepetitionPenalty::new(1.5).unwrap())]);
    rep.reset(&[0]);
    rep.accept(9);
    assert_eq!(
        rep.sample(&[0.0, 1.0, 2.0], &ctx0(), 0),
        Err(SampleError::TokenIdOutOfRange {
            field: "output_ids",
            token_id: 9,
            vocab_size: 3
        })
    );
    // The caller's row is left as it was.
    let row = vec![3.0f32, 1.0, 2.0, -1.0];
    let copy = row.clone();
    let mut busy = chain_of(vec![
        Box::new(Temperature::new(0.3).unwrap()),
        Box::new(TopK::new(2).unwrap()),
        Box::new(TopP::new(0.5).unwrap()),
    ]);
    busy.sample(&row, &ctx0(), 0).unwrap();
    busy.distribution(&row, &ctx0()).unwrap();
    assert_eq!(row, copy);
}

// ---------------------------------------------------------------------------------------------
// (2) Order matters
// ---------------------------------------------------------------------------------------------

#[test]
fn order_of_processors_matters() {
    let row = ln_row(&[0.4, 0.3, 0.2, 0.1]);
    // spec worked case: top_k 2 then top_p 0.5 -> only token 0 (4/7 >= 0.5 after
    // renormalising).
    let k_then_p = dist(
        vec![
            Box::new(TopK::new(2).unwrap()),
            Box::new(TopP::new(0.5).unwrap()),
        ],
        &row,
    );
    assert_close(&k_then_p, &[1.0, 0.0, 0.0, 0.0], 1e-6, "top_k then top_p");
    // top_p 0.5 first: 0.4 < 0.5 <= 0.7 keeps {0, 1}; top_k 2 then keeps both -> [4/7, 3/7].
    let p_then_k = dist(
        vec![
            Box::new(TopP::new(0.5).unwrap()),
            Box::new(TopK::new(2).unwrap()),
        ],
        &row,
    );
    assert_close(
        &p_then_k,
        &[4.0 / 7.0, 3.0 / 7.0, 0.0, 0.0],
        1e-6,
        "top_p then top_k",
    );

    // min_p 0.5 then temperature 0.5 on probs [0.5, 0.3, 0.2]: min_p keeps p >= 0.25 -> {0, 1};
    // T 0.5 squares the weights: [0.25, 0.09] / 0.34.
    let row = ln_row(&[0.5, 0.3, 0.2]);
    let min_p_first = dist(
        vec![
            Box::new(MinP::new(0.5).unwrap()),
            Box::new(Temperature::new(0.5).unwrap()),
        ],
        &row,
    );
    assert_close(
        &min_p_first,
        &[25.0 / 34.0, 9.0 / 34.0, 0.0],
        1e-6,
        "min_p then temperature",
    );
    // Temperature first: weights relative to the max are 0.36 and 0.16, both < 0.5 -> token 0.
    let t_first = dist(
        vec![
            Box::new(Temperature::new(0.5).unwrap()),
            Box::new(MinP::new(0.5).unwrap()),
        ],
        &row,
    );
    assert_close(&t_first, &[1.0, 0.0, 0.0], 1e-6, "temperature then min_p");
}

// ---------------------------------------------------------------------------------------------
// (3) The fixed chain equals the fast path
// ---------------------------------------------------------------------------------------------

struct Case {
    row: Vec<f32>,
    params: SamplingParams,
    prompt: Vec<u32>,
    output: Vec<u32>,
    stops: Vec<u32>,
    position: u64,
    sample_index: u32,
}

fn random_case(g: &mut SplitMix) -> Case {
    let vocab = 1 + g.below(200) as usize;
    let v = vocab as u64;
    let scale = [1.0, 3.0, 10.0][g.below(3) as usize];
    let set = [-3.0f32, -1.0, 0.0, 0.5, 1.0, 2.0, 2.5, 8.0];
    let row: Vec<f32> = (0..vocab)
        .map(|_| match g.below(10) {
            0 => NEG,
            1 | 2 => set[g.below(set.len() as u64) as usize],
            _ => (g.normal() * scale) as f32,
        })
        .collect();
    let ids = |g: &mut SplitMix, max_len: u64| -> Vec<u32> {
        let len = g.below(max_len + 1);
        (0..len).map(|_| g.below(v) as u32).collect()
    };
    let prompt = ids(g, 12);
    let output = ids(g, 12);
    let stops = ids(g, 2);
    let uniform = |g: &mut SplitMix, lo: f64, hi: f64| lo + (hi - lo) * g.next_f64();
    let temperature = match g.below(9) {
        0 => 0.0,
        1 => 1.0,
        _ => 10f64.powf(uniform(g, -4.0, 2.0)),
    };
    let top_k = if g.below(2) == 0 {
        0
    } else {
        g.below(v + 5) as i64 - 1
    };
    let top_p = match g.below(10) {
        0..=2 => 1.0,
        3 => 10f64.powf(uniform(g, -12.0, -3.0)),
        _ => uniform(g, 1e-3, 1.0),
    };
    let min_p = match g.below(10) {
        0..=4 => 0.0,
        5 => 1.0,
        _ => 10f64.powf(uniform(g, -6.0, -0.1)),
    };
    let repetition_penalty = match g.below(3) {
        0 => 1.0,
        _ => uniform(g, 0.5, 2.0),
    };
    let additive = |g: &mut SplitMix| match g.below(2) {
        0 => 0.0,
        _ => uniform(g, -2.0, 2.0),
    };
    let presence_penalty = additive(g);
    let frequency_penalty = additive(g);
    let logit_bias: BTreeMap<u32, f64> = if g.below(3) == 0 {
        (0..1 + g.below(4))
            .map(|_| (g.below(v) as u32, uniform(g, -150.0, 150.0)))
            .collect()
    } else {
        BTreeMap::new()
    };
    let allowed_token_ids = (g.below(6) == 0).then(|| {
        let mut a = ids(g, 7);
        a.push(g.below(v) as u32);
        a
    });
    let bad_words: Vec<Vec<u32>> = if g.below(4) == 0 {
        (0..1 + g.below(2))
            .map(|_| {
                let prefix = g.below(3) as usize;
                let mut w = if g.below(2) == 0 && output.len() >= prefix {
                    output[output.len() - prefix..].to_vec()
                } else {
                    (0..prefix).map(|_| g.below(v) as u32).collect()
                };
                w.push(g.below(v) as u32);
                w
            })
            .collect()
    } else {
        Vec::new()
    };
    let min_tokens = if g.below(3) == 0 {
        (output.len() as u64 + g.below(3)).saturating_sub(1) as usize
    } else {
        0
    };
    let n = if g.below(5) == 0 {
        1 + g.below(4) as usize
    } else {
        1
    };
    let logprobs = (g.below(4) == 0).then(|| g.below(v.min(5) + 1) as usize);
    let logprobs_kind = if g.below(2) == 0 {
        LogprobsKind::Processed
    } else {
        LogprobsKind::Raw
    };
    let params = SamplingParams {
        temperature,
        top_k,
        top_p,
        repetition_penalty,
        min_p,
        presence_penalty,
        frequency_penalty,
        logit_bias,
        allowed_token_ids,
        bad_words,
        min_tokens,
        seed: Some(g.next_u64()),
        n,
        logprobs,
        logprobs_kind,
        ..Default::default()
    };
    Case {
        row,
        params,
        prompt,
        output,
        stops,
        position: g.next_u64() >> g.below(64),
        sample_index: g.below(4) as u32,
    }
}

#[test]
fn fixed_chain_equals_the_fast_path_on_random_rows() {
    let mut g = SplitMix(0x00c4_a1b5_eed5);
    let (mut checked, mut skipped, mut errors) = (0usize, 0usize, 0usize);
    for case_no in 0..600 {
        let c = random_case(&mut g);
        let p = &c.params;
        let what = format!("case {case_no}: {:?} row {:?}", p, c.row);
        let req = SampleRequest::new(p, &c.prompt, &c.output, c.position)
            .with_stop_token_ids(&c.stops)
            .with_sample_index(c.sample_index);
        let mut chain = SamplerChain::from_params(p).unwrap();
        chain.reset(&c.prompt);
        for &t in &c.output {
            chain.accept(t);
        }
        let ctx =
            ProcessorContext::new(&c.prompt, &c.output, c.position).with_stop_token_ids(&c.stops);

        let fast_d = distribution(&c.row, &req);
        let fast_s = sample_row(&c.row, &req);
        let chain_d = chain.distribution(&c.row, &ctx);
        let chain_s = chain.sample(&c.row, &ctx, c.sample_index);

        let o = match oracle_with_stops(&c.row, p, &c.prompt, &c.output, &c.stops) {
            Err(OracleError::NoCandidates) => {
                assert_eq!(chain_d, Err(SampleError::NoCandidates), "{what}");
                assert_eq!(chain_s, Err(SampleError::NoCandidates), "{what}");
                assert_eq!(fast_d, Err(SampleError::NoCandidates), "{what}");
                errors += 1;
                continue;
            }
            Err(e) => panic!("{what}: oracle {e:?}"),
            Ok(o) => o,
        };
        let (fast_d, chain_d) = (fast_d.unwrap(), chain_d.unwrap());
        let (fast_s, chain_s) = (fast_s.unwrap(), chain_s.unwrap());
        // Always: a probability vector inside the hard constraints, the token in the support.
        let sum: f64 = chain_d.iter().sum();
        assert!((sum - 1.0).abs() <= 1e-9, "{what}: sum {sum}");
        for (i, &x) in chain_d.iter().enumerate() {
            if o.penalised[i] == f64::NEG_INFINITY {
                assert_eq!(x, 0.0, "{what}: id {i} is banned");
            }
        }
        assert!(chain_d[chain_s.token as usize] > 0.0, "{what}");
        assert_eq!(chain_s.extra_samples.len(), p.n - 1, "{what}");
        if !o.greedy {
            assert_eq!(chain_s.seed, p.seed.unwrap(), "{what}");
        }
        if o.fragile {
            skipped += 1;
            continue;
        }
        checked += 1;
        assert_close(&chain_d, &fast_d, 1e-6, &what);
        assert_eq!(chain_s.token, fast_s.token, "{what}");
        let chain_tokens: Vec<u32> = chain_s.tokens().collect();
        let fast_tokens: Vec<u32> = fast_s.tokens().collect();
        assert_eq!(chain_tokens, fast_tokens, "{what}");
        assert_eq!(chain_s.num_candidates, fast_s.num_candidates, "{what}");
        assert!(
            (chain_s.logprob - fast_s.logprob).abs() <= 1e-6,
            "{what}: {} vs {}",
            chain_s.logprob,
            fast_s.logprob
        );
        match (&chain_s.logprobs, &fast_s.logprobs) {
            (None, None) => {}
            (Some(a), Some(b)) => {
                assert_eq!(a.kind, b.kind, "{what}");
                assert_eq!(a.sampled.len(), b.sampled.len(), "{what}");
                for (x, y) in a.sampled.iter().zip(&b.sampled) {
                    assert!(x == y || (x - y).abs() <= 1e-6, "{what}: {x} vs {y}");
                }
                let a_ids: Vec<u32> = a.top.iter().map(|t| t.token_id).collect();
                let b_ids: Vec<u32> = b.top.iter().map(|t| t.token_id).collect();
                assert_eq!(a_ids, b_ids, "{what}");
                for (x, y) in a.top.iter().zip(&b.top) {
                    assert!(
                        x.logprob == y.logprob || (x.logprob - y.logprob).abs() <= 1e-6,
                        "{what}: {x:?} vs {y:?}"
                    );
                }
            }
            (a, b) => panic!("{what}: logprobs {a:?} vs {b:?}"),
        }
    }
    eprintln!("{checked} rows compared, {skipped} boundary rows skipped, {errors} error rows");
    assert!(checked >= 450, "only {checked} of 600 rows compared");
}

// ---------------------------------------------------------------------------------------------
// (4) State clones
// ---------------------------------------------------------------------------------------------

fn stateful_params() -> SamplingParams {
    SamplingParams {
        repetition_penalty: 1.3,
        frequency_penalty: 0.4,
        presence_penalty: 0.3,
        temperature: 0.9,
        seed: Some(7),
        ..Default::default()
    }
}

/// A chain fed `prompt` and `history` from scratch.
fn fresh(prompt: &[u32], history: &[u32]) -> SamplerChain {
    let mut chain = SamplerChain::from_params(&stateful_params()).unwrap();
    chain.reset(prompt);
    for &t in history {
        chain.accept(t);
    }
    chain
}

#[test]
fn forked_chains_keep_their_own_penalty_state() {
    let row: Vec<f32> = (0..8).map(|i| (i as f32 * 0.7).sin() * 3.0).collect();
    let prompt = [1u32, 2];
    let mut a = fresh(&prompt, &[3, 3, 4]);
    let mut b = a.clone();
    for t in [5, 3] {
        a.accept(t);
    }
    b.accept(0);

    let empty = ProcessorContext::new(&prompt, &[], 9);
    for (chain, history) in [(&mut a, &[3u32, 3, 4, 5, 3][..]), (&mut b, &[3, 3, 4, 0])] {
        let want = fresh(&prompt, history)
            .process(&row, &empty)
            .unwrap()
            .to_vec();
        let got = chain.process(&row, &empty).unwrap().to_vec();
        assert_eq!(got, want, "history {history:?}");
        // And the penalised logits are those of the spec (the f64 oracle; before temperature
        // they are what steps 4-5 give, so compare after undoing (l - max) / T).
        let o = oracle(&row, &stateful_params(), &prompt, history).unwrap();
        let max = o
            .penalised
            .iter()
            .copied()
            .fold(f64::NEG_INFINITY, f64::max);
        for (i, &l) in got.iter().enumerate() {
            let want = (o.penalised[i] - max) / 0.9;
            assert!(
                (f64::from(l) - want).abs() <= 1e-5,
                "history {history:?}, id {i}: {l} vs {want}"
            );
        }
        let ctx = ProcessorContext::new(&prompt, history, 9);
        assert_eq!(
            chain.sample(&row, &ctx, 0).unwrap(),
            fresh(&prompt, history).sample(&row, &ctx, 0).unwrap()
        );
    }
    // The two forks differ (a penalises 5 and 3 more, b penalises 0).
    assert_ne!(
        a.process(&row, &empty).unwrap().to_vec(),
        b.process(&row, &empty).unwrap().to_vec()
    );
    // reset starts over.
    a.reset(&prompt);
    assert_eq!(
        a.process(&row, &empty).unwrap().to_vec(),
        fresh(&prompt, &[]).process(&row, &empty).unwrap().to_vec()
    );
}

#[test]
fn a_cloned_boxed_processor_keeps_its_state() {
    let mut p: Box<dyn LogitsProcessor> =
        Box::new(FrequencyPresencePenalty::new(1.0, 0.0).unwrap());
    p.accept(1);
    let mut q = p.clone();
    q.accept(1);
    assert_eq!(applied(p.as_mut(), &[0.0, 0.0], &ctx0()), [0.0, -1.0]);
    assert_eq!(applied(q.as_mut(), &[0.0, 0.0], &ctx0()), [0.0, -2.0]);
}

// ---------------------------------------------------------------------------------------------
// (5) A user-defined processor
// ---------------------------------------------------------------------------------------------

/// Bans the token accepted last (a stateful user processor), and counts its calls.
#[derive(Clone, Debug, Default)]
struct NoImmediateRepeat {
    last: Option<u32>,
    calls: usize,
}

impl LogitsProcessor for NoImmediateRepeat {
    fn name(&self) -> &str {
        "no_immediate_repeat"
    }
    fn apply(
        &mut self,
        logits: &mut [f32],
        _ctx: &ProcessorContext<'_>,
    ) -> Result<(), SampleError> {
        self.calls += 1;
        if let Some(t) = self.last {
            logits[t as usize] = f32::NEG_INFINITY;
        }
        Ok(())
    }
    fn reset(&mut self, _prompt_ids: &[u32]) {
        self.last = None;
    }
    fn accept(&mut self, token: u32) {
        self.last = Some(token);
    }
    fn box_clone(&self) -> Box<dyn LogitsProcessor> {
        Box::new(self.clone())
    }
}

/// Writes NaN: the chain must report it, not sample from it.
#[derive(Clone, Debug)]
struct WritesNan;

impl LogitsProcessor for WritesNan {
    fn name(&self) -> &str {
        "writes_nan"
    }
    fn apply(
        &mut self,
        logits: &mut [f32],
        _ctx: &ProcessorContext<'_>,
    ) -> Result<(), SampleError> {
        logits[1] = f32::NAN;
        Ok(())
    }
    fn box_clone(&self) -> Box<dyn LogitsProcessor> {
        Box::new(self.clone())
    }
}

#[test]
fn a_user_defined_processor_works_in_a_chain() {
    let row = [0.0f32, 5.0, 3.0, 1.0];
    let mut chain = SamplerChain::new(Selection::greedy());
    chain
        .push(NoImmediateRepeat::default())
        .push(TopK::new(3).unwrap());
    assert_eq!(chain.processors()[0].name(), "no_immediate_repeat");
    chain.reset(&[]);
    // Greedy alternates between the two best tokens: 1, 2, 1, 2.
    let mut tokens = vec![];
    for step in 0..4u64 {
        let t = chain
            .sample(&row, &ProcessorContext::new(&[], &[], step), 0)
            .unwrap()
            .token;
        chain.accept(t);
        tokens.push(t);
    }
    assert_eq!(tokens, [1, 2, 1, 2]);
    // A fork keeps the user processor's state.
    let mut fork = chain.clone();
    assert_eq!(fork.sample(&row, &ctx0(), 0).unwrap().token, 1);
    fork.accept(1);
    assert_eq!(fork.sample(&row, &ctx0(), 0).unwrap().token, 2);
    assert_eq!(chain.sample(&row, &ctx0(), 0).unwrap().token, 1);
    // Under sampling: the banned token never comes.
    let mut sampling =
        SamplerChain::new(Selection::sample(Some(3))).with(NoImmediateRepeat::default());
    sampling.accept(1);
    for pos in 0..200u64 {
        let t = sampling
            .sample(&row, &ProcessorContext::new(&[], &[], pos), 0)
            .unwrap()
            .token;
        assert_ne!(t, 1);
    }
    // A processor that writes NaN is an error for the row.
    let mut nan = SamplerChain::new(Selection::greedy()).with(WritesNan);
    assert!(matches!(
        nan.sample(&row, &ctx0(), 0),
        Err(SampleError::NonFiniteLogits { token_id: 1, .. })
    ));
    // Chains nest: a chain is itself a processor.
    let inner = SamplerChain::new(Selection::greedy()).with(TopK::new(2).unwrap());
    let mut outer = SamplerChain::new(Selection::sample(Some(5))).with(inner);
    assert_eq!(support(&outer.distribution(&row, &ctx0()).unwrap()), [1, 2]);
}

// ---------------------------------------------------------------------------------------------
// (6) Configuration as JSON
// ---------------------------------------------------------------------------------------------

const FULL_CONFIG: &str = r#"[
    {"allowed_token_ids": {"ids": [0, 1, 2, 3, 4, 5]}},
    {"bad_words": {"words": [[1, 2], [5]]}},
    {"min_tokens": {"min_tokens": 5}},
    {"logit_bias": {"bias": {"3": -1.5, "4": 250}}},
    {"repetition_penalty": {"penalty": 1.1}},
    {"frequency_penalty": {"penalty": 0.5}},
    {"presence_penalty": {"penalty": 0.5}},
    {"temperature": {"t": 0.8}},
    {"min_p": {"p": 0.05}},
    {"top_k": {"k": 50}},
    {"top_p": {"p": 0.9}},
    {"sample": {"seed": 18446744073709551615, "n": 2, "logprobs": 5, "logprobs_kind": "raw"}}
]"#;

#[test]
fn config_round_trips_from_json_to_a_chain() {
    let config: Vec<ProcessorConfig> = serde_json::from_str(FULL_CONFIG).unwrap();
    assert_eq!(config.len(), 12);
    assert_eq!(
        config[3],
        ProcessorConfig::LogitBias {
            bias: [(3u32, -1.5), (4, 250.0)].into_iter().collect()
        }
    );
    // The seed is exact above 2^53.
    assert_eq!(
        config[11],
        ProcessorConfig::Sample {
            seed: Some(u64::MAX),
            n: 2,
            logprobs: Some(5),
            logprobs_kind: LogprobsKind::Raw
        }
    );
    // Serialise and read back: the same list.
    let text = serde_json::to_string(&config).unwrap();
    let again: Vec<ProcessorConfig> = serde_json::from_str(&text).unwrap();
    assert_eq!(again, config);
    assert!(text.contains("18446744073709551615"), "{text}");

    let mut chain = SamplerChain::from_config(&config).unwrap();
    let names: Vec<&str> = chain.processors().iter().map(|p| p.name()).collect();
    assert_eq!(
        names,
        [
            "allowed_token_ids",
            "bad_words",
            "min_tokens",
            "logit_bias",
            "repetition_penalty",
            "frequency_penalty",
            "presence_penalty",
            "temperature",
            "min_p",
            "top_k",
            "top_p"
        ]
    );
    assert_eq!(
        *chain.selection(),
        Selection::Sample {
            seed: Some(u64::MAX),
            n: 2,
            logprobs: Some(5),
            logprobs_kind: LogprobsKind::Raw
        }
    );
    // The same chain built by hand gives the same distribution.
    let mut by_hand = SamplerChain::new(*chain.selection());
    by_hand
        .push(AllowedTokenIds::new(vec![0, 1, 2, 3, 4, 5]).unwrap())
        .push(BadWords::new(vec![vec![1, 2], vec![5]]).unwrap())
        .push(MinTokens::new(5))
        .push(LogitBias::new([(3u32, -1.5), (4, 250.0)].into_iter().collect()).unwrap())
        .push(RepetitionPenalty::new(1.1).unwrap())
        .push(FrequencyPresencePenalty::frequency(0.5).unwrap())
        .push(FrequencyPresencePenalty::presence(0.5).unwrap())
        .push(Temperature::new(0.8).unwrap())
        .push(MinP::new(0.05).unwrap())
        .push(TopK::new(50).unwrap())
        .push(TopP::new(0.9).unwrap());
    let row: Vec<f32> = (0..8).map(|i| (i as f32 * 1.3).cos() * 2.0).collect();
    let output = [1u32, 0];
    let stops = [7u32];
    let ctx = ProcessorContext::new(&[2], &output, 3).with_stop_token_ids(&stops);
    for c in [&mut chain, &mut by_hand] {
        c.reset(&[2]);
        for &t in &output {
            c.accept(t);
        }
    }
    let d = chain.distribution(&row, &ctx).unwrap();
    assert_eq!(d, by_hand.distribution(&row, &ctx).unwrap());
    // Hard constraints: 6, 7 not allowed; 2 (after ..1) and 5 are bad words; 7 is a stop id.
    assert_eq!(d[2], 0.0);
    assert_eq!(d[5], 0.0);
    assert_eq!(d[6], 0.0);
    assert_eq!(d[7], 0.0);
    let out = chain.sample(&row, &ctx, 0).unwrap();
    assert_eq!(out.seed, u64::MAX);
    assert_eq!(out.extra_samples.len(), 1);
    assert_eq!(out.logprobs.unwrap().kind, LogprobsKind::Raw);

    // Minimal selections and defaults.
    let minimal: Vec<ProcessorConfig> =
        serde_json::from_str(r#"[{"top_k": {"k": -1}}, {"greedy": {}}]"#).unwrap();
    let chain = SamplerChain::from_config(&minimal).unwrap();
    assert_eq!(*chain.selection(), Selection::greedy());
    assert_eq!(
        serde_json::to_string(&minimal).unwrap(),
        r#"[{"top_k":{"k":-1}},{"greedy":{}}]"#
    );
    let sample: Vec<ProcessorConfig> = serde_json::from_str(r#"[{"sample": {}}]"#).unwrap();
    assert_eq!(
        *SamplerChain::from_config(&sample).unwrap().selection(),
        Selection::sample(None)
    );
}

fn parse(text: &str) -> Result<Vec<ProcessorConfig>, serde_json::Error> {
    serde_json::from_str(text)
}

#[test]
fn config_errors_are_typed() {
    // A selection step before the end.
    let c = parse(r#"[{"greedy": {}}, {"top_k": {"k": 2}}, {"sample": {}}]"#).unwrap();
    assert_eq!(
        SamplerChain::from_config(&c).unwrap_err(),
        ChainError::SelectionNotLast {
            index: 0,
            name: "greedy"
        }
    );
    // No selection at all, or an empty list.
    let c = parse(r#"[{"top_k": {"k": 2}}]"#).unwrap();
    assert_eq!(
        SamplerChain::from_config(&c).unwrap_err(),
        ChainError::NoSelection
    );
    assert_eq!(
        SamplerChain::from_config(&[]).unwrap_err(),
        ChainError::NoSelection
    );
    // Unknown names and fields are serde errors.
    assert!(parse(r#"[{"top_z": {"k": 2}}, {"greedy": {}}]"#).is_err());
    assert!(parse(r#"[{"top_k": {"k": 2, "extra": 1}}, {"greedy": {}}]"#).is_err());
    assert!(parse(r#"[{"sample": {"sed": 3}}]"#).is_err());
    assert!(parse(r#"[{"sample": {"logprobs_kind": "cooked"}}]"#).is_err());
    assert!(parse(r#"[{"temperature": {"t": "warm"}}, {"greedy": {}}]"#).is_err());
    assert!(parse(r#"[{"logit_bias": {"bias": {"x": 1}}}, {"greedy": {}}]"#).is_err());
    // A token id given twice is an error, not the last value silently.
    let dup = parse(r#"[{"logit_bias": {"bias": {"1": 5, "1": -5}}}, {"greedy": {}}]"#);
    assert!(
        dup.as_ref()
            .is_err_and(|e| e.to_string().contains("token id 1 appears more than once")),
        "{dup:?}"
    );

    // Non-finite values written as strings reach validation: a ParamError naming the field.
    let cases = [
        (r#"{"temperature": {"t": "nan"}}"#, "temperature"),
        (r#"{"temperature": {"t": "inf"}}"#, "temperature"),
        (r#"{"top_p": {"p": "-inf"}}"#, "top_p"),
        (r#"{"min_p": {"p": "NaN"}}"#, "min_p"),
        (
            r#"{"repetition_penalty": {"penalty": "inf"}}"#,
            "repetition_penalty",
        ),
        (
            r#"{"frequency_penalty": {"penalty": "nan"}}"#,
            "frequency_penalty",
        ),
        (
            r#"{"presence_penalty": {"penalty": "-inf"}}"#,
            "presence_penalty",
        ),
        (r#"{"logit_bias": {"bias": {"3": "inf"}}}"#, "logit_bias"),
        (r#"{"temperature": {"t": 0}}"#, "temperature"),
        (r#"{"top_k": {"k": -2}}"#, "top_k"),
        (r#"{"allowed_token_ids": {"ids": []}}"#, "allowed_token_ids"),
        (r#"{"bad_words": {"words": [[]]}}"#, "bad_words"),
    ];
    for (entry, field) in cases {
        let c = parse(&format!(
            r#"[{{"min_tokens": {{"min_tokens": 1}}}}, {entry}, {{"greedy": {{}}}}]"#
        ))
        .unwrap_or_else(|e| panic!("{entry}: {e}"));
        match SamplerChain::from_config(&c) {
            Err(ChainError::InvalidParams {
                index: 1, source, ..
            }) => assert_eq!(source.field, field, "{entry}"),
            other => panic!("{entry}: {other:?}"),
        }
    }
    // n out of range on the selection step.
    let c = parse(r#"[{"sample": {"n": 0}}]"#).unwrap();
    match SamplerChain::from_config(&c) {
        Err(ChainError::InvalidParams {
            index: 0,
            name: "sample",
            source,
        }) => assert_eq!(source.field, "n"),
        other => panic!("{other:?}"),
    }
    // Non-finite values serialise back as strings.
    let c = parse(r#"[{"temperature": {"t": "-inf"}}, {"greedy": {}}]"#).unwrap();
    assert_eq!(
        serde_json::to_string(&c).unwrap(),
        r#"[{"temperature":{"t":"-inf"}},{"greedy":{}}]"#
    );
}

#[test]
fn temperature_then_repetition_penalty_keeps_logit_signs_as_hugging_face() {
    // Issue 16's case: logits [1, 2, 3], token 0 seen, temperature 1 then repetition penalty 2.
    // Hugging Face (TemperatureLogitsWarper, then RepetitionPenaltyLogitsProcessor): the
    // temperature leaves [1, 2, 3]; l0 = 1 > 0 is divided: 0.5; p0 = e^0.5 / (e^0.5 + e^2 + e^3).
    let hf = |l: [f64; 3]| {
        let z: f64 = l.iter().map(|x| x.exp()).sum();
        l.map(|x| x.exp() / z)
    };
    for (t, penalised) in [
        (1.0, [0.5, 2.0, 3.0]),
        (0.5, [1.0, 4.0, 6.0]),
        (4.0, [0.125, 0.5, 0.75]),
    ] {
        let mut chain = chain_of(vec![
            Box::new(Temperature::new(t).unwrap()),
            Box::new(RepetitionPenalty::new(2.0).unwrap()),
        ]);
        chain.reset(&[0]);
        let d = chain.distribution(&[1.0, 2.0, 3.0], &ctx0()).unwrap();
        assert_close(&d, &hf(penalised), 1e-6, &format!("T {t} then penalty"));
    }
    let mut chain = chain_of(vec![
        Box::new(Temperature::new(1.0).unwrap()),
        Box::new(RepetitionPenalty::new(2.0).unwrap()),
    ]);
    chain.reset(&[0]);
    let d = chain.distribution(&[1.0, 2.0, 3.0], &ctx0()).unwrap();
    assert!((d[0] - 0.0566).abs() < 5e-5, "{d:?}");
    // Negative logits: [-1, 2, 3] with token 0 seen: -1 * 2 = -2 whatever the temperature's
    // place (the sign does not change under division by T > 0): T 0.5 first gives -2 * 2 = -4,
    // penalty first gives -2 / 0.5 = -4: this pair commutes.
    let run = |order: u8| {
        let t: Box<dyn LogitsProcessor> = Box::new(Temperature::new(0.5).unwrap());
        let r: Box<dyn LogitsProcessor> = Box::new(RepetitionPenalty::new(2.0).unwrap());
        let mut chain = chain_of(if order == 0 { vec![t, r] } else { vec![r, t] });
        chain.reset(&[0]);
        chain.process(&[-1.0, 2.0, 3.0], &ctx0()).unwrap().to_vec()
    };
    assert_eq!(run(0), [-4.0, 4.0, 6.0]);
    assert_eq!(run(1), [-4.0, 4.0, 6.0]);
}
