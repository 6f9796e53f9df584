//! Large rows (8,193 to 327,680 ids) against the f64 oracle of spec/sampling.md: steps 1-5
//! and the forms a row comes in (penalties with top-k and greedy on the sparse and dense
//! paths, logit_bias, bad_words and min_tokens, rows of mostly -inf, NaN and +inf anywhere,
//! f16 / bf16 and padded rows through `sample_batch`). The selection steps 6-11 are in
//! `large_rows/selection.rs`; what every case asserts and where its expected answer comes from
//! are in `common/large_rows.rs`.

use crate::common;

use std::collections::BTreeMap;
use std::time::Instant;

use common::large_rows::*;
use common::oracle::{oracle_with_stops, OracleError};
use common::{normal_row, SplitMix};
use half::{bf16, f16};
use nucleus_sampling::{
    distribution, sample_batch, sample_row, LogitsView, SampleError, SampleOutput, SampleRequest,
    SamplingParams,
};

// ---------------------------------------------------------------------------------------------
// Steps 3-5 with top-k and greedy: sparse and dense paths

/// A history of `total` ids: 60% in the prompt, the rest in the output, where every third id
/// repeats an earlier output id (frequency counts above 1); the new ids are drawn a quarter
/// from the `4 * total / 10` largest logits (so that penalties move ids across the top-k
/// cut), the rest anywhere.
fn history(row: &[f32], seed: u64, total: usize) -> Hist {
    let mut g = SplitMix(seed);
    let n = row.len() as u64;
    let top = top_ids(row, (total * 4 / 10).max(8));
    let split = total * 6 / 10;
    let (mut prompt, mut output) = (Vec::new(), Vec::new());
    for j in 0..total {
        if j >= split && j % 3 == 0 && !output.is_empty() {
            let again = output[g.below(output.len() as u64) as usize];
            output.push(again);
            continue;
        }
        let id = if j % 4 == 0 {
            top[g.below(top.len() as u64) as usize]
        } else {
            g.below(n) as u32
        };
        if j < split {
            prompt.push(id);
        } else {
            output.push(id);
        }
    }
    Hist {
        prompt,
        output,
        stops: Vec::new(),
    }
}

/// Repetition, frequency and presence penalties with top-k and greedy, over 256 and 20,000
/// history ids, with k on both sides of the sparse-path threshold vocab = 16 (k + touched ids)
/// for both readings of "touched" (distinct ids, or every context id).
#[test]
fn penalties_with_top_k_and_greedy_on_long_histories() {
    let mut t = Tally::new("penalties");
    let cases: [(usize, usize); 4] = [
        (32_000, 256),
        (151_936, 256),
        (151_936, 20_000),
        (327_680, 20_000),
    ];
    for (s, &(n, distinct)) in cases.iter().enumerate() {
        // Continuous logits on the smallest row; multiples of 2^-10 on the others, on which
        // the dyadic penalties below act exactly (the oracle then needs no perturbation pass
        // per id bit to bound their rounding, which costs seconds on these rows).
        let row = if n < 100_000 {
            normal_row(400 + s as u64, n, 3.0)
        } else {
            quantised(&normal_row(400 + s as u64, n, 3.0), 1.0 / 1024.0)
        };
        let h = history(&row, 500 + s as u64, distinct);
        let touched_distinct = h.distinct();
        let touched_all = h.prompt.len() + h.output.len();
        let mut ks: Vec<i64> = vec![1, 50, 1000];
        for touched in [touched_distinct, touched_all] {
            if n / 16 > touched + 1 {
                let k0 = (n / 16 - touched) as i64;
                ks.extend([k0 - 1, k0, k0 + 1]);
            }
        }
        ks.push((n / 16) as i64 + 1);
        let sets: [(&str, f64, f64, f64, f64); 4] = [
            ("rep 2, freq 0.5, pres 0.25", 2.0, 0.5, 0.25, 1.0),
            ("rep 1.3, freq 0.1, pres -0.7", 1.3, 0.1, -0.7, 0.7),
            ("rep 0.5, pres -2", 0.5, 0.0, -2.0, 2.5),
            ("freq 2, pres 2", 1.0, 2.0, 2.0, 0.3),
        ];
        for (j, &k) in ks.iter().enumerate() {
            let (what, rep, freq, pres, temperature) = sets[j % sets.len()];
            // The inexact set costs the oracle a perturbation pass per id bit: once per large
            // row (k = 50), otherwise on the smallest row only.
            let (what, rep, freq, pres) = if n > 100_000 && rep == 1.3 && k != 50 {
                ("rep 2, freq 0.5, pres 0.25", 2.0, 0.5, 0.25)
            } else {
                (what, rep, freq, pres)
            };
            let p = SamplingParams {
                temperature,
                top_k: k,
                repetition_penalty: rep,
                frequency_penalty: freq,
                presence_penalty: pres,
                ..seeded(600 + j as u64)
            };
            let name = format!(
                "vocab {n}, {touched_distinct} distinct history ids, {what}, top_k {k}, \
                 T {temperature}"
            );
            let c = check(&mut t, &name, &row, &p, &h);
            assert_support_size(&name, &c, (k as usize).min(n));
        }
        // Greedy: the penalised argmax. A presence penalty of -2 and a repetition penalty of
        // 0.5 raise the best history id above the row's maximum when they can.
        for (j, (rep, pres)) in [(2.0, 0.5), (0.5, -2.0)].into_iter().enumerate() {
            let p = SamplingParams {
                repetition_penalty: rep,
                presence_penalty: pres,
                frequency_penalty: 0.25,
                ..greedy(700 + j as u64)
            };
            let name = format!(
                "vocab {n}, {touched_distinct} distinct history ids, greedy, rep {rep}, \
                 pres {pres}"
            );
            let c = check(&mut t, &name, &row, &p, &h);
            let want = argmax(c.o.penalised.iter().copied());
            assert_one_hot(&name, &c, want);
        }
    }
    t.finish(90);
}

// ---------------------------------------------------------------------------------------------
// logit_bias, bad_words, min_tokens

/// Step 4 on large rows: a bias lifts the row's lowest token from the bottom to just below the
/// maximum (into every top-k), -100 drops the maximum out, a small bias moves the 60th token
/// just inside the top 50; with few and with thousands of biased ids (sparse and dense paths).
/// A bias of 1e6 acts as 100 (clamped): it makes a low token the argmax, and the distribution
/// is bitwise that of bias 100.
#[test]
fn logit_bias_moves_tokens_across_the_top_k_cut() {
    let mut t = Tally::new("logit_bias");
    for (s, &n) in SIZES.iter().enumerate() {
        // Multiples of 2^-10 and biases that are multiples of 2^-10: every biased logit is
        // exact in f32, so the oracle needs no rounding allowance.
        let row = quantised(&normal_row(800 + s as u64, n, 3.0), 1.0 / 1024.0);
        let order = top_ids(&row, n);
        let (max_id, min_id) = (order[0] as usize, order[n - 1] as usize);
        let lift = f64::from(row[max_id]) - f64::from(row[min_id]) - 0.5;
        // The 60th largest id gets 0.5 above the 50th value: inside the top 50.
        let id60 = order[59] as usize;
        let gap = f64::from(row[order[49] as usize]) - f64::from(row[id60]);
        let few: Vec<(u32, f64)> = vec![
            (min_id as u32, lift),
            (max_id as u32, -100.0),
            (id60 as u32, gap + 0.5),
            (0, 1.5),
            ((n - 1) as u32, -0.75),
        ];
        let mut many = few.clone();
        let mut g = SplitMix(900 + s as u64);
        while many.len() < 3_000 {
            let id = g.below(n as u64) as u32;
            if !many.iter().any(|&(i, _)| i == id) {
                many.push((id, (g.below(129) as f64 - 64.0) / 64.0));
            }
        }
        for (label, bias) in [("5 biased ids", &few), ("3000 biased ids", &many)] {
            let logit_bias: BTreeMap<u32, f64> = bias.iter().copied().collect();
            let biased: Vec<f64> = row
                .iter()
                .enumerate()
                .map(|(i, &l)| f64::from(l) + logit_bias.get(&(i as u32)).copied().unwrap_or(0.0))
                .collect();
            for (j, k) in [50i64, 1, 1000, (n / 16) as i64].into_iter().enumerate() {
                let p = SamplingParams {
                    top_k: k,
                    temperature: TEMPERATURES[(j + s) % 3],
                    logit_bias: logit_bias.clone(),
                    ..seeded(1_100 + j as u64)
                };
                let name = format!("vocab {n}, {label}, top_k {k}, T {}", p.temperature);
                let c = check(&mut t, &name, &row, &p, &Hist::default());
                assert_support_size(&name, &c, k as usize);
                assert_eq!(c.d[max_id], 0.0, "{name}: the lowered maximum");
                if k == 1 {
                    assert_one_hot(&name, &c, argmax(biased.iter().copied()));
                } else {
                    assert!(c.d[min_id] > 0.0, "{name}: the lifted lowest token");
                }
                if k >= 50 && label == "5 biased ids" {
                    assert!(c.d[id60] > 0.0, "{name}: id {id60} raised into the top 50");
                }
            }
            let p = SamplingParams {
                logit_bias: logit_bias.clone(),
                ..greedy(3)
            };
            let name = format!("vocab {n}, {label}, greedy");
            let c = check(&mut t, &name, &row, &p, &Hist::default());
            assert_one_hot(&name, &c, argmax(biased.iter().copied()));
        }
        // Clamping: 1e6 on the second-lowest token is 100, which makes it the argmax.
        let low = order[n - 2] as usize;
        for (j, k) in [0i64, 50, (n / 16) as i64].into_iter().enumerate() {
            let with = |b: f64| SamplingParams {
                top_k: k,
                temperature: [0.0, 2.5, 20.0][j],
                logit_bias: [(low as u32, b), (max_id as u32, -1e9)]
                    .into_iter()
                    .collect(),
                ..seeded(1_200)
            };
            let (p100, p1e6) = (with(100.0), with(1e6));
            let name = format!(
                "vocab {n}, bias 1e6 on id {low}, top_k {k}, T {}",
                p100.temperature
            );
            let c = check(&mut t, &name, &row, &p1e6, &Hist::default());
            let d100 = distribution(&row, &SampleRequest::new(&p100, &[], &[], 0)).unwrap();
            assert!(d100 == c.d, "{name}: bias 1e6 differs from bias 100");
            if j == 0 {
                assert_one_hot(&name, &c, low);
            } else {
                assert_eq!(argmax(c.d.iter().copied()), low, "{name}");
            }
        }
    }
    t.finish(90);
}

/// Step 3 on large rows: a one-token bad word, a three-token bad word whose prefix ends the
/// output, and min_tokens with the maximum and runner-up as stop ids, each banning the row's
/// maximum (and more) under greedy, top-k, top-p and plain sampling; a prefix that does not
/// match and min_tokens reached ban nothing.
#[test]
fn bad_words_and_min_tokens_ban_the_maximum() {
    let mut t = Tally::new("bad_words/min_tokens");
    for (s, &n) in SIZES.iter().enumerate() {
        let row = normal_row(1_200 + s as u64, n, 3.0);
        let order = top_ids(&row, 3);
        let (first, second, third) = (order[0], order[1], order[2]);
        let (a, b) = (17u32, (n - 5) as u32);
        let output = vec![3, 9, a, b];
        let plain_hist = Hist {
            output: output.clone(),
            ..Hist::default()
        };
        let stops_hist = Hist {
            output: output.clone(),
            stops: vec![second, first, 0],
            ..Hist::default()
        };
        type Ban = (&'static str, Vec<Vec<u32>>, usize, bool, Vec<u32>);
        let bans: [Ban; 5] = [
            ("bad word [max]", vec![vec![first]], 0, false, vec![first]),
            (
                "bad word [a, b, max]",
                vec![vec![a, b, first], vec![b, a, second]],
                0,
                false,
                vec![first],
            ),
            (
                "min_tokens 5 with output 4",
                vec![],
                5,
                true,
                vec![first, second, 0],
            ),
            ("min_tokens 4 reached", vec![], 4, true, vec![]),
            (
                "bad words and min_tokens",
                vec![vec![b, third], vec![9, a, b, (n - 1) as u32]],
                100,
                true,
                vec![first, second, third, 0, (n - 1) as u32],
            ),
        ];
        for (what, bad_words, min_tokens, stops, banned) in bans {
            let h = if stops { &stops_hist } else { &plain_hist };
            let base = SamplingParams {
                bad_words,
                min_tokens,
                ..seeded(1_300 + s as u64)
            };
            let params = [
                (
                    "greedy",
                    SamplingParams {
                        temperature: 0.0,
                        ..base.clone()
                    },
                ),
                (
                    "top_k 50",
                    SamplingParams {
                        top_k: 50,
                        temperature: 0.3,
                        ..base.clone()
                    },
                ),
                (
                    "top_p 0.9",
                    SamplingParams {
                        top_p: 0.9,
                        ..base.clone()
                    },
                ),
                (
                    "plain T 2.5",
                    SamplingParams {
                        temperature: 2.5,
                        ..base.clone()
                    },
                ),
            ];
            for (pname, p) in &params {
                let name = format!("vocab {n}, {what}, {pname}");
                let c = check(&mut t, &name, &row, p, h);
                for &id in &banned {
                    assert_eq!(c.d[id as usize], 0.0, "{name}: id {id} is banned");
                }
                if *pname == "greedy" {
                    let want = top_ids(&row, 8)
                        .into_iter()
                        .find(|i| !banned.contains(i))
                        .unwrap();
                    assert_one_hot(&name, &c, want as usize);
                } else if banned.is_empty() {
                    assert!(c.d[first as usize] > 0.0, "{name}: nothing is banned");
                }
            }
        }
    }
    t.finish(90);
}

// ---------------------------------------------------------------------------------------------
// -inf

/// Rows that are -inf except a few ids at run, block and chunk boundaries and the last id:
/// masked ids stay at 0 under every filter, penalty and bias; one finite id is one-hot; none
/// is NoCandidates, also when allowed_token_ids or bad words leave only -inf ids.
#[test]
fn rows_of_mostly_neg_inf() {
    let mut t = Tally::new("-inf rows");
    for &n in &SIZES {
        let finite = [0, 31, 32, 511, 512, 8_191, 8_192, n - 1];
        let values = [1.5f32, -2.0, 3.25, 0.5, 3.25, -7.0, 2.0, 0.75];
        let mut row = vec![f32::NEG_INFINITY; n];
        for (&i, &v) in finite.iter().zip(&values) {
            row[i] = v;
        }
        let h = Hist {
            prompt: vec![31, 100, 511, 8_192],
            output: vec![0, 0, 4_000, (n - 2) as u32, 32],
            stops: vec![],
        };
        let empty = Hist::default();
        let cases: Vec<(&str, SamplingParams, &Hist)> = vec![
            ("greedy", greedy(1), &empty),
            (
                "top_k 1",
                SamplingParams {
                    top_k: 1,
                    ..seeded(2)
                },
                &empty,
            ),
            (
                "top_k 3",
                SamplingParams {
                    top_k: 3,
                    ..seeded(3)
                },
                &empty,
            ),
            (
                "top_k 8",
                SamplingParams {
                    top_k: 8,
                    ..seeded(4)
                },
                &empty,
            ),
            (
                "top_k 50",
                SamplingParams {
                    top_k: 50,
                    ..seeded(5)
                },
                &empty,
            ),
            (
                "top_p 0.5",
                SamplingParams {
                    top_p: 0.5,
                    ..seeded(6)
                },
                &empty,
            ),
            (
                "top_p 0.9 T 2.5",
                SamplingParams {
                    top_p: 0.9,
                    temperature: 2.5,
                    ..seeded(7)
                },
                &empty,
            ),
            (
                "min_p 0.1",
                SamplingParams {
                    min_p: 0.1,
                    ..seeded(8)
                },
                &empty,
            ),
            (
                "plain T 0.3",
                SamplingParams {
                    temperature: 0.3,
                    ..seeded(9)
                },
                &empty,
            ),
            (
                "penalties on finite and -inf ids, top_k 4",
                SamplingParams {
                    top_k: 4,
                    repetition_penalty: 2.0,
                    presence_penalty: -2.0,
                    frequency_penalty: -1.0,
                    ..seeded(10)
                },
                &h,
            ),
            (
                "bias +100 on -inf ids",
                SamplingParams {
                    logit_bias: [
                        (1u32, 100.0),
                        (4_000, 100.0),
                        ((n - 2) as u32, 50.0),
                        (31, 5.0),
                    ]
                    .into_iter()
                    .collect(),
                    ..seeded(11)
                },
                &empty,
            ),
            (
                "allowed ids mixing finite and -inf",
                SamplingParams {
                    allowed_token_ids: Some(vec![1, 2, 31, 512, (n - 1) as u32, (n - 2) as u32]),
                    top_k: 2,
                    ..seeded(12)
                },
                &empty,
            ),
        ];
        for (what, p, h) in &cases {
            let name = format!("vocab {n}, 8 finite ids, {what}");
            let c = check(&mut t, &name, &row, p, h);
            for (i, &x) in c.d.iter().enumerate() {
                if row[i] == f32::NEG_INFINITY {
                    assert_eq!(x, 0.0, "{name}: masked id {i}");
                }
            }
            if *what == "greedy" || *what == "top_k 1" {
                assert_one_hot(&name, &c, 32);
            }
        }
        // One finite id, in the last run.
        let mut one = vec![f32::NEG_INFINITY; n];
        one[n - 1] = -1e4;
        for (what, p) in [
            ("greedy", greedy(1)),
            (
                "top_p 0.5 min_p 0.9",
                SamplingParams {
                    top_p: 0.5,
                    min_p: 0.9,
                    ..seeded(2)
                },
            ),
            (
                "top_k 1000",
                SamplingParams {
                    top_k: 1000,
                    ..seeded(3)
                },
            ),
        ] {
            let name = format!("vocab {n}, one finite id at vocab-1, {what}");
            let c = check(&mut t, &name, &one, &p, &Hist::default());
            assert_one_hot(&name, &c, n - 1);
        }
        // Nothing left: NoCandidates.
        let all = vec![f32::NEG_INFINITY; n];
        let nothing: [(&str, &[f32], SamplingParams, Hist); 4] = [
            ("all -inf, greedy", &all, greedy(1), Hist::default()),
            (
                "all -inf, top_k 5",
                &all,
                SamplingParams {
                    top_k: 5,
                    ..seeded(1)
                },
                Hist::default(),
            ),
            (
                "allowed ids all -inf",
                &row,
                SamplingParams {
                    allowed_token_ids: Some(vec![1, 30, 33, 513, (n - 3) as u32]),
                    top_p: 0.9,
                    ..seeded(1)
                },
                Hist::default(),
            ),
            (
                "bad words and min_tokens ban every finite id",
                &row,
                SamplingParams {
                    bad_words: finite[..6].iter().map(|&i| vec![i as u32]).collect(),
                    min_tokens: 1,
                    logit_bias: [(1u32, 100.0)].into_iter().collect(),
                    ..seeded(1)
                },
                Hist {
                    stops: vec![8_192, (n - 1) as u32],
                    ..Hist::default()
                },
            ),
        ];
        for (what, r, p, h) in &nothing {
            assert_eq!(
                oracle_with_stops(r, p, &h.prompt, &h.output, &h.stops).unwrap_err(),
                OracleError::NoCandidates,
                "{what}"
            );
            assert_eq!(
                distribution(r, &h.request(p, 0, 0)),
                Err(SampleError::NoCandidates),
                "vocab {n}, {what}"
            );
            assert_eq!(
                sample_row(r, &h.request(p, 9, 0)),
                Err(SampleError::NoCandidates),
                "vocab {n}, {what}"
            );
        }
    }
    t.finish(95);
}

// ---------------------------------------------------------------------------------------------
// NaN and +inf

/// The id and value of a `NonFiniteLogits` error, if `r` is one.
fn non_finite(r: &Result<SampleOutput, SampleError>) -> Option<(usize, f32)> {
    match r {
        Err(SampleError::NonFiniteLogits { token_id, value }) => Some((*token_id as usize, *value)),
        _ => None,
    }
}

/// Step 1 on large rows: a NaN (quiet, negative, signalling) or +inf below vocab_size is an
/// error naming the lowest such id, wherever it lies (id 0, run and block and chunk boundaries,
/// the last runs), under every path (greedy, top-k, top-p, min-p, sparse penalties), also when
/// the id is masked by allowed_token_ids or banned, and when the rest of the row is -inf.
#[test]
fn non_finite_logits_are_errors_wherever_they_lie() {
    let started = Instant::now();
    let bad_values = [
        f32::NAN,
        f32::INFINITY,
        f32::from_bits(0xFFC0_0000), // negative quiet NaN
        f32::from_bits(0x7F80_0001), // signalling NaN
        f32::from_bits(0xFFFF_FFFF),
    ];
    let mut calls = 0;
    for (s, &n) in [8_193usize, 50_257, 151_936].iter().enumerate() {
        let base = normal_row(2_300 + s as u64, n, 3.0);
        let mut neg = vec![f32::NEG_INFINITY; n];
        neg[n / 2] = 1.0;
        let positions = [
            0,
            1,
            31,
            32,
            511,
            512,
            8_191,
            8_192,
            n - 33,
            n - 32,
            n - 17,
            n - 2,
            n - 1,
        ];
        let h = Hist {
            prompt: vec![5, 6, 7],
            output: vec![8, 9],
            stops: vec![],
        };
        for (pi, &pos) in positions.iter().enumerate() {
            let bad = bad_values[pi % bad_values.len()];
            let others: Vec<u32> = [3u32, 40, (n / 2) as u32]
                .into_iter()
                .filter(|&i| i as usize != pos)
                .collect();
            let params = [
                ("greedy", greedy(1)),
                (
                    "top_k 50",
                    SamplingParams {
                        top_k: 50,
                        ..seeded(2)
                    },
                ),
                (
                    "top_p 0.9",
                    SamplingParams {
                        top_p: 0.9,
                        ..seeded(3)
                    },
                ),
                (
                    "min_p 0.1",
                    SamplingParams {
                        min_p: 0.1,
                        ..seeded(4)
                    },
                ),
                ("plain", seeded(5)),
                (
                    "penalties, bias, top_k 20",
                    SamplingParams {
                        top_k: 20,
                        repetition_penalty: 1.5,
                        presence_penalty: 1.0,
                        logit_bias: [(pos as u32, -100.0)].into_iter().collect(),
                        ..seeded(6)
                    },
                ),
                (
                    "id masked by allowed_token_ids",
                    SamplingParams {
                        allowed_token_ids: Some(others.clone()),
                        ..seeded(7)
                    },
                ),
                (
                    "id banned by a bad word, greedy",
                    SamplingParams {
                        bad_words: vec![vec![pos as u32]],
                        ..greedy(8)
                    },
                ),
            ];
            for (rname, r) in [("normal row", &base), ("-inf row", &neg)] {
                let mut row = r.clone();
                row[pos] = bad;
                // A second bad value later in the row does not change the reported id.
                let mut two = row.clone();
                two[(pos + 4_099) % n] = f32::NAN;
                if (pos + 4_099) % n < pos {
                    two[(pos + 4_099) % n] = r[(pos + 4_099) % n];
                }
                for (pname, p) in &params {
                    for (variant, row) in [("one", &row), ("two", &two)] {
                        let name =
                            format!("vocab {n}, {rname}, {bad:?} at {pos} ({variant}), {pname}");
                        let req = h.request(p, 11, 0);
                        for got in [
                            distribution(row, &req).map(|_| ()),
                            sample_row(row, &req).map(|_| ()),
                        ] {
                            calls += 1;
                            match got {
                                Err(SampleError::NonFiniteLogits { token_id, value }) => {
                                    assert_eq!(token_id as usize, pos, "{name}");
                                    assert!(
                                        value.to_bits() == bad.to_bits()
                                            || (value.is_nan() && bad.is_nan()),
                                        "{name}: value {value:?}"
                                    );
                                }
                                other => panic!("{name}: expected NonFiniteLogits, got {other:?}"),
                            }
                        }
                    }
                }
            }
        }
        // In a batch, the bad rows fail alone.
        let mut bad_row = base.clone();
        bad_row[n - 1] = f32::NAN;
        let mut data = base.clone();
        data.extend_from_slice(&bad_row);
        data.extend_from_slice(&base);
        let view = LogitsView::dense(&data, 3, n).unwrap();
        let p = SamplingParams {
            top_k: 50,
            ..seeded(42)
        };
        let e = Hist::default();
        let out = sample_batch(
            &view,
            &[
                e.request(&p, 3, 0),
                e.request(&p, 3, 0),
                e.request(&p, 3, 0),
            ],
        )
        .unwrap();
        let alone = sample_row(&base, &e.request(&p, 3, 0)).unwrap();
        assert_eq!(out[0].as_ref().unwrap(), &alone);
        assert_eq!(out[2].as_ref().unwrap(), &alone);
        assert_eq!(
            non_finite(&out[1]).map(|e| e.0),
            Some(n - 1),
            "{:?}",
            out[1]
        );
    }
    eprintln!("non-finite: {calls} calls, {:.2?}", started.elapsed());
}

// ---------------------------------------------------------------------------------------------
// f16 / bf16 rows and padded rows through LogitsView + sample_batch

/// Checks every row of a batch: `sample_batch` equals `sample_row` on the widened row (the
/// vocab part), bitwise, and the widened row passes `check` against the oracle.
fn check_batch<T: nucleus_sampling::LogitValue>(
    t: &mut Tally,
    label: &str,
    view: &LogitsView<'_, T>,
    widened: &[Vec<f32>],
    params: &[SamplingParams],
) {
    let h = Hist::default();
    let requests: Vec<SampleRequest<'_>> = params
        .iter()
        .enumerate()
        .map(|(i, p)| h.request(p, DRAWS[i % 3].0, DRAWS[i % 3].1))
        .collect();
    let out = sample_batch(view, &requests).unwrap();
    for (i, ((got, row), req)) in out.iter().zip(widened).zip(&requests).enumerate() {
        let name = format!("{label}, row {i}, {:?}", params[i]);
        assert_eq!(row.len(), view.vocab_size());
        let want = sample_row(row, req);
        assert_eq!(
            got, &want,
            "{name}: sample_batch differs from sample_row on the widened row"
        );
        let c = check(t, &name, row, &params[i], &h);
        assert_eq!(got.as_ref().unwrap().token, c.tokens[i % 3], "{name}");
    }
}

fn batch_params() -> Vec<SamplingParams> {
    vec![
        greedy(1),
        SamplingParams {
            top_k: 50,
            temperature: 0.7,
            ..seeded(2)
        },
        SamplingParams {
            top_p: 0.9,
            ..seeded(3)
        },
        SamplingParams {
            min_p: 0.05,
            temperature: 1.5,
            ..seeded(4)
        },
        SamplingParams {
            temperature: 1.0,
            ..seeded(5)
        },
        SamplingParams {
            top_k: 1000,
            top_p: 0.8,
            temperature: 2.5,
            ..seeded(6)
        },
    ]
}

/// f16 and bf16 rows (many exact ties after rounding; -inf entries; huge bf16 values that take
/// the exact fallback) through `LogitsView` and `sample_batch`.
#[test]
fn f16_and_bf16_rows_through_sample_batch() {
    let mut t = Tally::new("f16/bf16");
    let params = batch_params();
    for (s, &n) in [32_000usize, 50_257, 151_936].iter().enumerate() {
        let rows: Vec<Vec<f32>> = (0..params.len())
            .map(|i| {
                let mut r = normal_row(2_400 + 10 * s as u64 + i as u64, n, 3.0);
                for j in (i..n).step_by(61) {
                    r[j] = f32::NEG_INFINITY;
                }
                r
            })
            .collect();
        // f16: rounding to 11 significant bits makes ties at the cuts.
        let data: Vec<f16> = rows.iter().flatten().map(|&x| f16::from_f32(x)).collect();
        let widened: Vec<Vec<f32>> = data
            .chunks(n)
            .map(|r| r.iter().map(|x| x.to_f32()).collect())
            .collect();
        let view = LogitsView::dense(&data, params.len(), n).unwrap();
        check_batch(&mut t, &format!("f16, vocab {n}"), &view, &widened, &params);
        // bf16: ordinary rows and rows scaled by 1e37 (|max| > 1e30), at T = 1e38.
        let mut huge_params = params.clone();
        for (i, p) in huge_params.iter_mut().enumerate() {
            if i % 2 == 1 && !p.is_greedy() {
                p.temperature = 1e38;
            }
        }
        let data: Vec<bf16> = rows
            .iter()
            .enumerate()
            .flat_map(|(i, r)| {
                let scale = if i % 2 == 1 { 1e37 } else { 1.0 };
                r.iter().map(move |&x| bf16::from_f32(x * scale))
            })
            .collect();
        let widened: Vec<Vec<f32>> = data
            .chunks(n)
            .map(|r| r.iter().map(|x| x.to_f32()).collect())
            .collect();
        let view = LogitsView::dense(&data, params.len(), n).unwrap();
        check_batch(
            &mut t,
            &format!("bf16, vocab {n}"),
            &view,
            &widened,
            &huge_params,
        );
    }
    // An f16 NaN and an f16 +inf row beside healthy rows.
    let n = 50_257;
    let healthy: Vec<f16> = normal_row(2_500, n, 3.0)
        .iter()
        .map(|&x| f16::from_f32(x))
        .collect();
    let mut data = healthy.clone();
    let mut nan = healthy.clone();
    nan[512] = f16::NAN;
    let mut inf = healthy.clone();
    inf[n - 1] = f16::INFINITY;
    data.extend(nan);
    data.extend(inf);
    let view = LogitsView::dense(&data, 3, n).unwrap();
    let p = SamplingParams {
        top_p: 0.9,
        ..seeded(8)
    };
    let h = Hist::default();
    let out = sample_batch(
        &view,
        &[
            h.request(&p, 1, 0),
            h.request(&p, 1, 0),
            h.request(&p, 1, 0),
        ],
    )
    .unwrap();
    assert!(out[0].is_ok());
    let (id, value) = non_finite(&out[1]).expect("NonFiniteLogits");
    assert!(id == 512 && value.is_nan(), "{:?}", out[1]);
    assert_eq!(
        non_finite(&out[2]),
        Some((n - 1, f32::INFINITY)),
        "{:?}",
        out[2]
    );
    t.finish(90);
}

/// Padded rows: row_len 151,936 for a 151,665-token vocabulary, padding of NaN, +inf and values
/// above every logit, and a row stride with more junk between rows. The padding is never a
/// candidate, never an error and never the maximum: the batch equals `sample_row` on the
/// vocab part. A NaN at vocab_size - 1 is still an error.
#[test]
fn padded_rows_ignore_the_padding() {
    let mut t = Tally::new("padded");
    let (vocab, row_len) = (151_665usize, 151_936usize);
    let params = batch_params();
    let fills = [
        f32::NAN,
        f32::INFINITY,
        3e38,
        f32::MAX,
        1e4,
        f32::from_bits(0xFFC0_0001),
    ];
    for (stride, label) in [
        (row_len, "stride = row_len"),
        (row_len + 128, "stride = row_len + 128"),
    ] {
        let mut data = vec![f32::NAN; stride * (params.len() - 1) + row_len];
        let mut widened = Vec::new();
        for i in 0..params.len() {
            let mut r = if i % 2 == 0 {
                normal_row(2_600 + i as u64, vocab, 3.0)
            } else {
                peaked_row(2_600 + i as u64, vocab)
            };
            if i == 3 {
                r[vocab - 1] = 25.0; // the maximum in the last vocab id, next to the padding
            }
            let start = i * stride;
            data[start..start + vocab].copy_from_slice(&r);
            for (j, x) in data[start + vocab..start + row_len].iter_mut().enumerate() {
                *x = fills[(i + j) % fills.len()];
            }
            widened.push(r);
        }
        let view = LogitsView::new(&data, params.len(), row_len, stride, vocab).unwrap();
        check_batch(
            &mut t,
            &format!("f32 padded, {label}"),
            &view,
            &widened,
            &params,
        );
        // The same in f16 (padding of f16 NaN, +inf and 65504).
        let data16: Vec<f16> = data.iter().map(|&x| f16::from_f32(x)).collect();
        let widened16: Vec<Vec<f32>> = widened
            .iter()
            .map(|r| r.iter().map(|&x| f16::from_f32(x).to_f32()).collect())
            .collect();
        let view = LogitsView::new(&data16, params.len(), row_len, stride, vocab).unwrap();
        check_batch(
            &mut t,
            &format!("f16 padded, {label}"),
            &view,
            &widened16,
            &params,
        );
    }
    // A NaN at vocab_size - 1 is an error; at vocab_size it is padding.
    let mut data = normal_row(2_700, row_len, 3.0);
    data.extend(normal_row(2_701, row_len, 3.0));
    data[vocab - 1] = f32::NAN;
    data[row_len + vocab] = f32::NAN;
    let view = LogitsView::new(&data, 2, row_len, row_len, vocab).unwrap();
    let p = greedy(1);
    let h = Hist::default();
    let out = sample_batch(&view, &[h.request(&p, 0, 0), h.request(&p, 0, 0)]).unwrap();
    assert_eq!(
        non_finite(&out[0]).map(|e| e.0),
        Some(vocab - 1),
        "{:?}",
        out[0]
    );
    let want = top_ids(&data[row_len..row_len + vocab], 1)[0];
    assert_eq!(out[1].as_ref().unwrap().token, want);
    t.finish(90);
}
