//! Batch invariance (spec/sampling.md, first paragraph and "Random streams"): a request's
//! token and logprob (bitwise) do not depend on the batch size, the row's place in the batch
//! or the thread count. Checked with small rows and with 151,936-entry padded rows (Qwen's
//! embedding table for a 151,665-token tokenizer), so a within-row split is exercised if the
//! implementation has one.

mod common;

use common::oracle::oracle_with_stops;
use common::{inverse_cdf, normal_row, spec_uniform};
use nucleus_sampling::{
    distribution, sample_batch, sample_row, LogitsView, LogprobsKind, SampleOutput, SampleRequest,
    SamplingParams,
};

/// EOS and stop ids of every request (banned while fewer than `min_tokens` were generated).
const STOPS: [u32; 2] = [3, 11];

/// The last generated id in `check`, so that the target's bad word `[OUTPUT_LAST, 17]` bans 17.
const OUTPUT_LAST: u32 = 2;

/// The target request and 15 neighbours of varied parameters (greedy, top-k 1, top-p, ...).
fn all_params() -> Vec<SamplingParams> {
    let target = SamplingParams {
        temperature: 0.8,
        // 1000 is off for the small rows; for the 151,665-token rows it keeps the top-p cut
        // among probabilities ~1e-3, away from rounding (with top-p alone over the whole tail
        // the prefix masses step by ~1e-5 and one lands within 1e-6 of p too often).
        top_k: 1000,
        top_p: 0.95,
        repetition_penalty: 1.15,
        min_p: 0.01,
        presence_penalty: 0.4,
        frequency_penalty: 0.25,
        logit_bias: [(5u32, 3.0), (11, -150.0), (40, 250.0)]
            .into_iter()
            .collect(),
        bad_words: vec![vec![13], vec![OUTPUT_LAST, 17]],
        min_tokens: 12,
        seed: Some(42),
        ..Default::default()
    };
    let mut v = vec![target];
    for i in 0..15u64 {
        v.push(SamplingParams {
            temperature: [0.0, 0.3, 1.0, 1.5, 4.0][i as usize % 5],
            top_k: [0, 1, 20, -1][i as usize % 4],
            top_p: [1.0, 0.9, 0.5][i as usize % 3],
            repetition_penalty: [1.0, 1.2][i as usize % 2],
            min_p: [0.0, 0.05, 1.0][i as usize % 3],
            presence_penalty: [0.0, -1.0, 2.0][i as usize % 3],
            frequency_penalty: [0.5, 0.0][i as usize % 2],
            logit_bias: [(i as u32, 1e6), (i as u32 + 20, -2.5)]
                .into_iter()
                .collect(),
            allowed_token_ids: (i % 4 == 3).then(|| (0..60).collect()),
            bad_words: vec![vec![i as u32 + 1, i as u32 + 2]],
            min_tokens: [0, 30][i as usize % 2],
            seed: Some(1000 + i),
            n: [1, 3, 1, 2, 5][i as usize % 5],
            logprobs: [None, Some(0), Some(4), Some(70)][i as usize % 4],
            logprobs_kind: [LogprobsKind::Raw, LogprobsKind::Processed][i as usize % 2],
            // The extended processors of spec/sampling.md (one or two per neighbour, so that
            // each runs beside the others in one batch; these rows take the chain path).
            sequence_bias: if i == 1 {
                vec![(vec![OUTPUT_LAST, 9], 4.0), (vec![12], -1.0)]
            } else {
                vec![]
            },
            dry_multiplier: if i == 2 || i == 9 { 0.8 } else { 0.0 },
            dry_sequence_breakers: if i == 2 { vec![vec![5]] } else { vec![] },
            no_repeat_ngram_size: if i == 3 { 2 } else { 0 },
            dynatemp_range: if i == 4 { 0.5 } else { 0.0 },
            typical_p: if i == 5 { 0.9 } else { 1.0 },
            top_n_sigma: if i == 6 { 1.5 } else { -1.0 },
            epsilon_cutoff: if i == 7 { 3e-3 } else { 0.0 },
            eta_cutoff: if i == 8 { 3e-3 } else { 0.0 },
            xtc_probability: if i == 9 || i == 10 { 0.7 } else { 0.0 },
            min_keep: if i == 10 { 5 } else { 1 },
            mirostat: [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 2, 0, 0][i as usize],
            ..Default::default()
        });
    }
    v
}

fn pool(threads: usize) -> rayon::ThreadPool {
    rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build()
        .expect("thread pool")
}

/// Row data for `rows`, each `vocab` values padded to `row_len` with NaN and huge values.
fn padded(rows: &[Vec<f32>], row_len: usize) -> Vec<f32> {
    let mut data = Vec::with_capacity(rows.len() * row_len);
    for r in rows {
        data.extend_from_slice(r);
        for j in r.len()..row_len {
            data.push(if j % 2 == 0 { f32::NAN } else { 1e30 });
        }
    }
    data
}

/// Bitwise equality of every field, extra samples and logprobs included (`Debug` prints each
/// f64 in its shortest round-trip form, so equal text means equal bits).
fn same(a: &SampleOutput, b: &SampleOutput) -> bool {
    format!("{a:?}") == format!("{b:?}")
}

fn check(vocab: usize, row_len: usize, positions: &[u64]) {
    let params = all_params();
    let prompt: Vec<u32> = (0..40).map(|i| (i * 7919 % vocab) as u32).collect();
    let output: Vec<u32> = (0..10)
        .map(|i| (i * 104_729 % vocab) as u32)
        .chain([OUTPUT_LAST])
        .collect();
    let rows: Vec<Vec<f32>> = (0..16)
        .map(|i| normal_row(i as u64 + 1, vocab, 2.5))
        .collect();
    let p1 = pool(1);
    let p2 = pool(2);

    for &position in positions {
        let reqs: Vec<SampleRequest> = params
            .iter()
            .map(|p| SampleRequest::new(p, &prompt, &output, position).with_stop_token_ids(&STOPS))
            .collect();
        // The reference: each row alone through sample_row, on the default pool.
        let alone: Vec<SampleOutput> = rows
            .iter()
            .zip(&reqs)
            .map(|(r, q)| sample_row(r, q).expect("sample_row"))
            .collect();

        // The target is spec-correct, so invariance is not vacuous.
        let o = oracle_with_stops(&rows[0], &params[0], &prompt, &output, &STOPS).unwrap();
        assert!(o.probs[alone[0].token as usize] > 0.0);
        // The target's hard constraints bite: the bad word and the stop ids (min_tokens).
        for banned in [17usize, 3, 11] {
            assert!(!o.support[banned], "id {banned} should be banned");
        }
        // Fixed rows and positions: they must be clear of rounding boundaries, so the check
        // always runs.
        assert!(
            !o.fragile,
            "vocab {vocab}: row on a rounding boundary; pick another"
        );
        let u = spec_uniform(42, position, 0);
        let want = inverse_cdf(&o.probs, u, 1e-5).expect("u on a boundary; pick another position");
        assert_eq!(alone[0].token, want, "vocab {vocab}, position {position}");

        // Orders: target first (identity) and target last (reversed).
        let orders: [Vec<usize>; 2] = [(0..16).collect(), (0..16).rev().collect()];
        for (pool_name, pool) in [
            ("default", None),
            ("1 thread", Some(&p1)),
            ("2 threads", Some(&p2)),
        ] {
            let install = |f: &(dyn Fn() -> Vec<Option<SampleOutput>> + Sync)| match pool {
                Some(p) => p.install(f),
                None => f(),
            };
            // Alone, as a batch of one.
            let single = install(&|| {
                let data = padded(&rows[..1], row_len);
                let view = LogitsView::new(&data, 1, row_len, row_len, vocab).unwrap();
                sample_batch(&view, &reqs[..1])
                    .unwrap()
                    .into_iter()
                    .map(Result::ok)
                    .collect()
            });
            let got = single[0].as_ref().expect("target alone");
            assert!(
                same(got, &alone[0]),
                "{pool_name}: batch of 1 {got:?} vs sample_row {:?}",
                alone[0]
            );
            // sample_row itself inside the pool.
            let in_pool = install(&|| vec![sample_row(&rows[0], &reqs[0]).ok()]);
            assert!(
                same(in_pool[0].as_ref().unwrap(), &alone[0]),
                "{pool_name}: sample_row"
            );

            for order in &orders {
                let res = install(&|| {
                    let ordered: Vec<Vec<f32>> = order.iter().map(|&i| rows[i].clone()).collect();
                    let data = padded(&ordered, row_len);
                    let view = LogitsView::new(&data, 16, row_len, row_len, vocab).unwrap();
                    let ordered_reqs: Vec<SampleRequest> = order.iter().map(|&i| reqs[i]).collect();
                    sample_batch(&view, &ordered_reqs)
                        .unwrap()
                        .into_iter()
                        .map(Result::ok)
                        .collect()
                });
                for (slot, &i) in order.iter().enumerate() {
                    let got = res[slot].as_ref().expect("row");
                    assert!(
                        same(got, &alone[i]),
                        "{pool_name}, vocab {vocab}, position {position}: row {i} in slot {slot} gave {got:?}, alone {:?}",
                        alone[i]
                    );
                }
            }
        }
    }

    // The distribution is bitwise the same whatever the thread count.
    let req = SampleRequest::new(&params[0], &prompt, &output, 0).with_stop_token_ids(&STOPS);
    let d0 = distribution(&rows[0], &req).unwrap();
    for p in [&p1, &p2] {
        let d = p.install(|| distribution(&rows[0], &req).unwrap());
        assert!(d.iter().zip(&d0).all(|(a, b)| a.to_bits() == b.to_bits()));
    }
}

#[test]
fn small_rows_same_tokens_alone_first_last_and_any_thread_count() {
    check(97, 97, &[0, 1, 2, 50, 1 << 33]);
    check(97, 128, &[7]);
}

#[test]
fn qwen_sized_padded_rows_same_tokens_alone_first_last_and_any_thread_count() {
    check(151_665, 151_936, &[0, 123_456]);
}

/// Each path of the sampler on one 600,000-entry row (long enough that its passes are split
/// across the pool's idle threads): bitwise the same output and distribution on 1, 2 and 3
/// threads.
#[test]
fn every_path_is_thread_count_invariant_on_a_long_row() {
    let vocab = 600_000;
    let mut row = normal_row(77, vocab, 3.0);
    for (i, id) in [5usize, 40_000, 99_999, 599_999].into_iter().enumerate() {
        row[id] = 14.0 + i as f32;
    }
    row[120_000] = f32::NEG_INFINITY;
    let output: Vec<u32> = (0..256).map(|i| (i * 593) % vocab as u32).collect();
    let base = SamplingParams {
        seed: Some(9),
        n: 3,
        logprobs: Some(5),
        ..Default::default()
    };
    let cases = [
        SamplingParams {
            seed: Some(9),
            ..SamplingParams::greedy()
        },
        SamplingParams {
            top_k: 50,
            ..base.clone()
        },
        SamplingParams {
            top_p: 0.9,
            ..base.clone()
        },
        SamplingParams {
            temperature: 0.7,
            top_p: 0.5,
            ..base.clone()
        },
        SamplingParams {
            min_p: 0.05,
            ..base.clone()
        },
        SamplingParams {
            temperature: 1.3,
            ..base.clone()
        },
        SamplingParams {
            temperature: 0.8,
            top_k: 50,
            top_p: 0.9,
            repetition_penalty: 1.1,
            frequency_penalty: 0.3,
            logit_bias: [(7, 30.0)].into_iter().collect(),
            logprobs_kind: LogprobsKind::Raw,
            ..base.clone()
        },
        SamplingParams {
            repetition_penalty: 1.1,
            top_p: 0.8,
            ..base.clone()
        },
    ];
    for params in &cases {
        let req = SampleRequest::new(params, &[], &output, 300);
        let one = pool(1).install(|| {
            (
                sample_row(&row, &req).unwrap(),
                distribution(&row, &req).unwrap(),
            )
        });
        for threads in [2, 3] {
            let got = pool(threads).install(|| {
                (
                    sample_row(&row, &req).unwrap(),
                    distribution(&row, &req).unwrap(),
                )
            });
            assert!(
                same(&got.0, &one.0),
                "{threads} threads, {params:?}: {:?} vs {:?}",
                got.0,
                one.0
            );
            assert!(
                got.1
                    .iter()
                    .zip(&one.1)
                    .all(|(a, b)| a.to_bits() == b.to_bits()),
                "{threads} threads, {params:?}: distributions differ"
            );
            // A batch of one on that pool (split) equals the same row in a batch of 3 (not split).
            let data: Vec<f32> = row.iter().chain(&row).chain(&row).copied().collect();
            let view = LogitsView::dense(&data, 3, vocab).unwrap();
            let batch = pool(threads).install(|| sample_batch(&view, &[req, req, req]).unwrap());
            for r in &batch {
                assert!(
                    same(r.as_ref().unwrap(), &one.0),
                    "{threads} threads, batch of 3, {params:?}"
                );
            }
        }
    }
}
