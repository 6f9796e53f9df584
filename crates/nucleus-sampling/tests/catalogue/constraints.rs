//! The catalogue's constraint and penalty processors (issue 16), each against Hugging Face's
//! documented semantics (src/transformers/generation/logits_process.py): `SequenceBias`,
//! `ForcedBos`, `ForcedEos`, `SuppressTokens`, `SuppressTokensAtBegin`,
//! `ExponentialDecayLengthPenalty`, `RepetitionPenalty::with_prompt_ignore_length`,
//! `EncoderRepetitionPenalty` and `InfNanRemove`.
//!
//! Per processor: (a) table tests worked by hand, the arithmetic in a comment; (b) a slow f64
//! oracle written here from the anchor's semantics, compared on random rows and contexts;
//! (c) parameter errors naming the field; (d) state through reset / accept / clone. Expected
//! values never come from running the implementation.

use crate::common;

use std::collections::{BTreeSet, HashSet};

use common::{assert_close, SplitMix};
use nucleus_sampling::chain::{
    ChainError, EncoderRepetitionPenalty, ExponentialDecayLengthPenalty, ForcedBos, ForcedEos,
    InfNanRemove, LogitsProcessor, ProcessorConfig, ProcessorContext, RepetitionPenalty,
    SamplerChain, Selection, SequenceBias, SuppressTokens, SuppressTokensAtBegin,
};
use nucleus_sampling::SampleError;

const NEG: f32 = f32::NEG_INFINITY;

/// Applies one processor alone to a copy of `logits`.
fn applied(p: &mut dyn LogitsProcessor, logits: &[f32], ctx: &ProcessorContext<'_>) -> Vec<f32> {
    let mut row = logits.to_vec();
    p.apply(&mut row, ctx).unwrap();
    row
}

/// `[0, 1, ..., n - 1]` as f32 logits.
fn iota(n: usize) -> Vec<f32> {
    (0..n).map(|i| i as f32).collect()
}

/// `got` equals the oracle's `want`: `-inf` exactly, finite values within 1e-6 relative.
#[track_caller]
fn assert_row(got: &[f32], want: &[f64], what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        if w == f64::NEG_INFINITY {
            assert_eq!(g, NEG, "{what}: entry {i}: got {g}, want -inf");
        } else {
            let tol = 1e-6 * w.abs().max(1.0);
            assert!(
                g.is_finite() && (f64::from(g) - w).abs() <= tol,
                "{what}: entry {i}: got {g}, want {w}"
            );
        }
    }
}

/// A random row of `vocab` logits, about 10% of them `-inf`.
fn random_row(g: &mut SplitMix, vocab: usize) -> Vec<f32> {
    (0..vocab)
        .map(|_| {
            if g.below(10) == 0 {
                NEG
            } else {
                (g.normal() * 3.0) as f32
            }
        })
        .collect()
}

/// Random ids, mostly from a small alphabet (so that sequences repeat and match).
fn random_ids(g: &mut SplitMix, vocab: usize, max_len: u64) -> Vec<u32> {
    let len = g.below(max_len + 1) as usize;
    let alphabet = vocab.min(4) as u64;
    (0..len)
        .map(|_| {
            if g.below(4) == 0 {
                g.below(vocab as u64) as u32
            } else {
                g.below(alphabet) as u32
            }
        })
        .collect()
}

const VOCABS: [usize; 4] = [5, 37, 1000, 4096];

// ---------------------------------------------------------------------------------------------
// SequenceBias (Hugging Face's SequenceBiasLogitsProcessor)
// ---------------------------------------------------------------------------------------------

fn hand_sequence_bias() -> SequenceBias {
    SequenceBias::new(vec![
        (vec![1, 2], -1.5),       // A: prefix [1]
        (vec![3], 0.5),           // B: one token, always
        (vec![0, 1, 2], 2.0),     // C: prefix [0, 1]
        (vec![4, 2], 1.0),        // D: prefix [4]
        (vec![5, 0, 1, 2], 10.0), // E: prefix [5, 0, 1]
        (vec![0, 1, 3], 0.25),    // F: prefix [0, 1]
    ])
    .unwrap()
}

#[test]
fn sequence_bias_worked_cases() {
    let row = iota(10);
    // (prompt, output, want l2, want l3); every other logit unchanged. l2 = 2 + matching of
    // A (-1.5), C (+2), D (+1), E (+10); l3 = 3 + B (0.5) + F (0.25 if it matches). A
    // sequence longer than prompt + output is skipped, as Hugging Face's `len(sequence_ids) >
    // input_ids.shape[1]`.
    let cases: [(&[u32], &[u32], f32, f32); 9] = [
        // [5, 0 | 1]: A (ends 1), C and F across the boundary (0 | 1); E has 4 > 3 tokens:
        // skipped though its prefix [5, 0, 1] is the whole sequence. l2 = 2 - 1.5 + 2 = 2.5,
        // l3 = 3 + 0.5 + 0.25 = 3.75.
        (&[5, 0], &[1], 2.5, 3.75),
        // The same sequence all in the prompt, then all in the output.
        (&[5, 0, 1], &[], 2.5, 3.75),
        (&[], &[5, 0, 1], 2.5, 3.75),
        // [9, 5, 0 | 1]: 4 tokens, E fits now: l2 = 2 - 1.5 + 2 + 10 = 12.5.
        (&[9, 5, 0], &[1], 12.5, 3.75),
        // [0 | 1]: 2 tokens; C and F (3 tokens) skipped though their prefix [0, 1] is the whole
        // sequence; A matches: l2 = 0.5, l3 = 3.5.
        (&[0], &[1], 0.5, 3.5),
        (&[], &[0, 1], 0.5, 3.5),
        // [1]: A has 2 > 1 tokens: skipped (its prefix [1] is the whole sequence). l3 = 3.5.
        (&[1], &[], 2.0, 3.5),
        // [7, 1]: A matches: l2 = 0.5.
        (&[7, 1], &[], 0.5, 3.5),
        // Nothing so far: B only.
        (&[], &[], 2.0, 3.5),
    ];
    let mut p = hand_sequence_bias();
    for (prompt, output, l2, l3) in cases {
        let ctx = ProcessorContext::new(prompt, output, 0);
        let mut want = iota(10);
        want[2] = l2;
        want[3] = l3;
        assert_eq!(applied(&mut p, &row, &ctx), want, "{prompt:?} | {output:?}");
    }
    // D's prefix [4] matching: [4] -> l2 = 2 + 1 = 3; -inf stays -inf.
    let ctx = ProcessorContext::new(&[6, 4], &[], 0);
    let mut masked = iota(10);
    masked[3] = NEG;
    let mut want = iota(10);
    want[2] = 3.0;
    want[3] = NEG;
    assert_eq!(applied(&mut p, &masked, &ctx), want);
}

#[test]
fn sequence_bias_repeated_sequences_keep_the_last_bias_and_sums_add() {
    // Hugging Face turns the list into a dict: [3] -> -1.0 (the last), [1, 2] -> 1.0.
    let mut p = SequenceBias::new(vec![
        (vec![3], 0.5),
        (vec![1, 2], -1.5),
        (vec![3], -1.0),
        (vec![1, 2], 1.0),
        (vec![0, 2], 0.25),
    ])
    .unwrap();
    assert_eq!(
        p.sequence_bias(),
        &[(vec![3], -1.0), (vec![1, 2], 1.0), (vec![0, 2], 0.25)]
    );
    // Output ends with 1: l2 = 2 + 1 = 3, l3 = 3 - 1 = 2.
    let ctx = ProcessorContext::new(&[0], &[1], 0);
    assert_eq!(applied(&mut p, &iota(4), &ctx), [0.0, 1.0, 3.0, 2.0]);
    // Ends with 0: l2 = 2 + 0.25.
    let ctx = ProcessorContext::new(&[1], &[0], 0);
    assert_eq!(applied(&mut p, &iota(4), &ctx), [0.0, 1.0, 2.25, 2.0]);
    // Two sequences ending in token 2 both matching add: [0, 5 | 1]: [5, 1, 2] -> +4,
    // [1, 2] -> +1: l2 = 2 + 4 + 1 = 7. With [5 | 1] (2 tokens) [5, 1, 2] is skipped: 3.
    let mut p = SequenceBias::new(vec![(vec![5, 1, 2], 4.0), (vec![1, 2], 1.0)]).unwrap();
    let ctx = ProcessorContext::new(&[0, 5], &[1], 0);
    assert_eq!(applied(&mut p, &iota(6), &ctx)[2], 7.0);
    let ctx = ProcessorContext::new(&[5], &[1], 0);
    assert_eq!(applied(&mut p, &iota(6), &ctx)[2], 3.0);
}

/// Hugging Face's semantics, slowly: the list as a dict, the whole sequence as one vector, a
/// bias per id in f64.
fn sequence_bias_oracle(
    row: &[f32],
    prompt: &[u32],
    output: &[u32],
    entries: &[(Vec<u32>, f64)],
) -> Vec<f64> {
    let mut dict: Vec<(Vec<u32>, f64)> = Vec::new();
    for (ids, b) in entries {
        if let Some(e) = dict.iter_mut().find(|e| &e.0 == ids) {
            e.1 = *b;
        } else {
            dict.push((ids.clone(), *b));
        }
    }
    let full: Vec<u32> = prompt.iter().chain(output).copied().collect();
    let mut bias = vec![0.0f64; row.len()];
    for (ids, b) in &dict {
        let last = *ids.last().unwrap() as usize;
        if ids.len() == 1 {
            bias[last] += b;
        } else if ids.len() <= full.len() {
            let prefix = &ids[..ids.len() - 1];
            if full[full.len() - prefix.len()..] == *prefix {
                bias[last] += b;
            }
        }
    }
    row.iter()
        .zip(&bias)
        .map(|(&l, b)| f64::from(l) + b)
        .collect()
}

#[test]
fn sequence_bias_equals_the_oracle_on_random_rows() {
    let mut g = SplitMix(0x05e9_b1a5);
    for &vocab in &VOCABS {
        for _ in 0..60 {
            let prompt = random_ids(&mut g, vocab, 6);
            let output = random_ids(&mut g, vocab, 6);
            let full: Vec<u32> = prompt.iter().chain(&output).copied().collect();
            let n = 1 + g.below(6) as usize;
            let entries: Vec<(Vec<u32>, f64)> = (0..n)
                .map(|_| {
                    let mut ids = random_ids(&mut g, vocab, 3);
                    // Half the time a suffix of the sequence (a match, often across the
                    // prompt / output boundary) with a random last token.
                    if g.below(2) == 0 && !full.is_empty() {
                        let k = 1 + g.below(full.len().min(4) as u64) as usize;
                        ids = full[full.len() - k..].to_vec();
                    }
                    ids.push(g.below(vocab as u64) as u32);
                    (
                        ids,
                        (g.normal() * 2.0 * 8.0).round() / 8.0 + g.next_f64() * 1e-3,
                    )
                })
                .collect();
            let row = random_row(&mut g, vocab);
            let mut p = SequenceBias::new(entries.clone()).unwrap();
            let ctx = ProcessorContext::new(&prompt, &output, 0);
            let got = applied(&mut p, &row, &ctx);
            let want = sequence_bias_oracle(&row, &prompt, &output, &entries);
            assert_row(&got, &want, &format!("{entries:?} {prompt:?}|{output:?}"));
        }
    }
}

// ---------------------------------------------------------------------------------------------
// ForcedBos, ForcedEos (ForcedBOSTokenLogitsProcessor, ForcedEOSTokenLogitsProcessor)
// ---------------------------------------------------------------------------------------------

#[test]
fn forced_bos_forces_the_first_generated_token_only() {
    let mut p = ForcedBos::new(1);
    // No token generated yet: every logit -inf, the BOS 0 (even a -inf BOS), whatever the
    // prompt's length.
    for prompt in [&[][..], &[4], &[3, 3, 0]] {
        let ctx = ProcessorContext::new(prompt, &[], 0);
        assert_eq!(applied(&mut p, &[1.0, 2.0, 3.0], &ctx), [NEG, 0.0, NEG]);
        assert_eq!(applied(&mut p, &[1.0, NEG, 3.0], &ctx), [NEG, 0.0, NEG]);
    }
    // One token generated: unchanged.
    let ctx = ProcessorContext::new(&[4], &[1], 0);
    assert_eq!(applied(&mut p, &[1.0, 2.0, 3.0], &ctx), [1.0, 2.0, 3.0]);
}

#[test]
fn forced_eos_forces_at_max_length_minus_one_only() {
    // max_length 6 (prompt included), eos [3, 1]; prompt of 2 tokens.
    let mut p = ForcedEos::new(6, vec![3, 1, 3]).unwrap();
    assert_eq!(p.eos_token_id(), &[1, 3]);
    let row = [0.5f32, 1.5, 2.5, 3.5, 4.5];
    let prompt = [4u32, 4];
    let forced = [NEG, 0.0, NEG, 0.0, NEG];
    // 2 + 2 = 4 = max_length - 2: unchanged; 2 + 3 = 5 = max_length - 1: forced (both EOS
    // 0); 2 + 4 = 6 = max_length: unchanged (past it too).
    for (generated, want) in [(2, &row), (3, &forced), (4, &row), (5, &row)] {
        let output = vec![0u32; generated];
        let ctx = ProcessorContext::new(&prompt, &output, 0);
        assert_eq!(applied(&mut p, &row, &ctx), *want, "{generated} generated");
    }
    // The length counts prompt and output together: 5 prompt tokens, nothing generated.
    let ctx = ProcessorContext::new(&[0, 0, 0, 0, 0], &[], 0);
    assert_eq!(applied(&mut p, &row, &ctx), forced);
    // max_length 1: forced on an empty sequence.
    let mut p = ForcedEos::new(1, vec![0]).unwrap();
    let ctx = ProcessorContext::new(&[], &[], 0);
    assert_eq!(applied(&mut p, &[NEG, 5.0], &ctx), [0.0, NEG]);
}

#[test]
fn forced_tokens_equal_the_oracle_on_random_rows() {
    let mut g = SplitMix(0x00f0_4ced);
    for &vocab in &VOCABS {
        for _ in 0..40 {
            let row = random_row(&mut g, vocab);
            let prompt = random_ids(&mut g, vocab, 4);
            let output = random_ids(&mut g, vocab, 4);
            let ctx = ProcessorContext::new(&prompt, &output, 0);
            let total = prompt.len() + output.len();
            let bos = g.below(vocab as u64) as u32;
            let want: Vec<f32> = if output.is_empty() {
                (0..vocab as u32)
                    .map(|i| if i == bos { 0.0 } else { NEG })
                    .collect()
            } else {
                row.clone()
            };
            assert_eq!(applied(&mut ForcedBos::new(bos), &row, &ctx), want);

            let max_length = 1 + g.below(10) as usize;
            let eos: Vec<u32> = (0..1 + g.below(3))
                .map(|_| g.below(vocab as u64) as u32)
                .collect();
            let want: Vec<f32> = if total + 1 == max_length {
                (0..vocab as u32)
                    .map(|i| if eos.contains(&i) { 0.0 } else { NEG })
                    .collect()
            } else {
                row.clone()
            };
            let mut p = ForcedEos::new(max_length, eos.clone()).unwrap();
            assert_eq!(applied(&mut p, &row, &ctx), want, "{max_length} {eos:?}");
        }
    }
}

// ---------------------------------------------------------------------------------------------
// SuppressTokens, SuppressTokensAtBegin
// ---------------------------------------------------------------------------------------------

#[test]
fn suppress_tokens_worked_cases() {
    let row = [1.0f32, 2.0, 3.0, 4.0];
    let ctx = ProcessorContext::new(&[0], &[1, 2], 0);
    let mut p = SuppressTokens::new(vec![3, 1, 3]);
    assert_eq!(p.suppress_tokens(), &[1, 3]);
    assert_eq!(applied(&mut p, &row, &ctx), [1.0, NEG, 3.0, NEG]);
    // An empty list suppresses nothing.
    assert_eq!(applied(&mut SuppressTokens::new(vec![]), &row, &ctx), row);

    // At begin, default 0: only while no token was generated.
    let mut p = SuppressTokensAtBegin::new(vec![2, 0], 0);
    let none = ProcessorContext::new(&[3, 3], &[], 0);
    assert_eq!(applied(&mut p, &row, &none), [NEG, 2.0, NEG, 4.0]);
    let one = ProcessorContext::new(&[3, 3], &[1], 0);
    assert_eq!(applied(&mut p, &row, &one), row);
    // begin_index 2: at 1 generated no, at 2 yes, at 3 no.
    let mut p = SuppressTokensAtBegin::new(vec![2], 2);
    for (generated, want) in [(1, row), (2, [1.0, 2.0, NEG, 4.0]), (3, row)] {
        let output = vec![1u32; generated];
        let ctx = ProcessorContext::new(&[0, 0, 0, 0], &output, 0);
        assert_eq!(applied(&mut p, &row, &ctx), want, "{generated} generated");
    }
}

#[test]
fn suppression_equals_the_oracle_on_random_rows() {
    let mut g = SplitMix(0x0005_9e55);
    for &vocab in &VOCABS {
        for _ in 0..40 {
            let row = random_row(&mut g, vocab);
            let ids = random_ids(&mut g, vocab, 5);
            let output = random_ids(&mut g, vocab, 3);
            let ctx = ProcessorContext::new(&[], &output, 0);
            let banned: HashSet<u32> = ids.iter().copied().collect();
            let want: Vec<f32> = (0..vocab)
                .map(|i| {
                    if banned.contains(&(i as u32)) {
                        NEG
                    } else {
                        row[i]
                    }
                })
                .collect();
            assert_eq!(
                applied(&mut SuppressTokens::new(ids.clone()), &row, &ctx),
                want
            );
            let begin = g.below(4) as usize;
            let want_begin = if output.len() == begin {
                want
            } else {
                row.clone()
            };
            let mut p = SuppressTokensAtBegin::new(ids, begin);
            assert_eq!(applied(&mut p, &row, &ctx), want_begin);
        }
    }
}

// ---------------------------------------------------------------------------------------------
// ExponentialDecayLengthPenalty
// ---------------------------------------------------------------------------------------------

#[test]
fn exponential_decay_worked_cases() {
    // start_index 2, decay_factor 1.5, eos [1, 3]; l1 = 2, l3 = -2. With g generated and
    // k = g - 2 > 0: l + |l| * (1.5^k - 1).
    let row = [0.5f32, 2.0, 7.0, -2.0];
    let mut p = ExponentialDecayLengthPenalty::new(2, 1.5, Some(vec![3, 1])).unwrap();
    let cases: [(usize, f32, f32); 5] = [
        (1, 2.0, -2.0),
        // g = start_index: unchanged.
        (2, 2.0, -2.0),
        // k = 1: factor 0.5: 2 + 2 * 0.5 = 3; -2 + 2 * 0.5 = -1.
        (3, 3.0, -1.0),
        // k = 2: factor 1.25: 2 + 2.5 = 4.5; -2 + 2.5 = 0.5 (past 0).
        (4, 4.5, 0.5),
        // k = 3: factor 2.375: 2 + 4.75 = 6.75; -2 + 4.75 = 2.75.
        (5, 6.75, 2.75),
    ];
    for (generated, l1, l3) in cases {
        let output = vec![0u32; generated];
        // The prompt's length does not count.
        let ctx = ProcessorContext::new(&[2, 2, 2], &output, 0);
        assert_eq!(
            applied(&mut p, &row, &ctx),
            [0.5, l1, 7.0, l3],
            "{generated} generated"
        );
    }
    // decay_factor 0.5, k = 1: factor -0.5: 2 - 1 = 1; -2 - 1 = -3.
    let mut p = ExponentialDecayLengthPenalty::new(0, 0.5, Some(vec![1, 3])).unwrap();
    let ctx = ProcessorContext::new(&[], &[0], 0);
    assert_eq!(applied(&mut p, &row, &ctx), [0.5, 1.0, 7.0, -3.0]);
    // Without eos_token_id: the context's stop ids, each distinct id once ([3, 3] applied
    // twice would give -1 + 1 * 0.5 = -0.5). A -inf EOS stays -inf (Hugging Face: NaN).
    let mut p = ExponentialDecayLengthPenalty::new(2, 1.5, None).unwrap();
    let output = [0u32; 3];
    let stops = [3u32, 3, 0];
    let ctx = ProcessorContext::new(&[], &output, 0).with_stop_token_ids(&stops);
    assert_eq!(
        applied(&mut p, &[NEG, 2.0, 7.0, -2.0], &ctx),
        [NEG, 2.0, 7.0, -1.0]
    );
    // No stop ids, no eos_token_id: nothing to do.
    let ctx = ProcessorContext::new(&[], &output, 0);
    assert_eq!(applied(&mut p, &row, &ctx), row);
    // A factor beyond the f32 range is an overflow error, the row left as it was:
    // 1e38 + 1e38 * 9 > f32::MAX.
    let mut p = ExponentialDecayLengthPenalty::new(0, 10.0, Some(vec![1])).unwrap();
    let mut big = [0.0f32, 1e38, 0.0];
    let err = p
        .apply(&mut big, &ProcessorContext::new(&[], &[0], 0))
        .unwrap_err();
    assert_eq!(
        err,
        SampleError::ProcessorOverflow {
            processor: "exponential_decay_length_penalty",
            token_id: 1,
            logit: 1e38
        }
    );
    assert_eq!(big, [0.0, 1e38, 0.0]);
}

#[test]
fn exponential_decay_equals_the_oracle_on_random_rows() {
    let mut g = SplitMix(0x000d_eca1);
    for &vocab in &VOCABS {
        for _ in 0..40 {
            let row = random_row(&mut g, vocab);
            let output = random_ids(&mut g, vocab, 8);
            let stops = random_ids(&mut g, vocab, 3);
            let start = g.below(6) as usize;
            let factor = 0.5 + g.next_f64() * 1.5;
            let entry_ids = (g.below(2) == 0).then(|| {
                (0..1 + g.below(3))
                    .map(|_| g.below(vocab as u64) as u32)
                    .collect::<Vec<u32>>()
            });
            let eos: HashSet<u32> = entry_ids
                .clone()
                .unwrap_or_else(|| stops.clone())
                .into_iter()
                .collect();
            let want: Vec<f64> = (0..vocab)
                .map(|i| {
                    let l = f64::from(row[i]);
                    if output.len() > start && eos.contains(&(i as u32)) && l.is_finite() {
                        let k = (output.len() - start) as i32;
                        l + l.abs() * (factor.powi(k) - 1.0)
                    } else {
                        l
                    }
                })
                .collect();
            let mut p = ExponentialDecayLengthPenalty::new(start, factor, entry_ids).unwrap();
            let ctx = ProcessorContext::new(&[1, 2], &output, 0).with_stop_token_ids(&stops);
            assert_row(&applied(&mut p, &row, &ctx), &want, "exponential decay");
        }
    }
}

// ---------------------------------------------------------------------------------------------
// RepetitionPenalty::with_prompt_ignore_length, EncoderRepetitionPenalty
// ---------------------------------------------------------------------------------------------

/// Penalty 2 over `[1, 2, 1] ++ output`, the first `ignore` ids not counted, on `row`.
fn ignoring(ignore: Option<usize>, prompt: &[u32], output: &[u32], row: &[f32]) -> Vec<f32> {
    let mut p = RepetitionPenalty::new(2.0).unwrap();
    if let Some(n) = ignore {
        p = p.with_prompt_ignore_length(n);
    }
    p.reset(prompt);
    for &t in output {
        p.accept(t);
    }
    applied(&mut p, row, &ProcessorContext::default())
}

#[test]
fn prompt_ignore_length_worked_cases() {
    // l = [1, 4, 4, -1]; penalty 2: l > 0 ? l / 2 : l * 2.
    let row = [1.0f32, 4.0, 4.0, -1.0];
    let prompt = [1u32, 2, 1];
    let output = [3u32];
    // Sequence [1, 2, 1 | 3]. Ignoring 2: counted [1, 3] (id 1 straddles: ignored at index 0,
    // counted at index 2): l1 = 2, l2 stays 4, l3 = -2.
    assert_eq!(
        ignoring(Some(2), &prompt, &output, &row),
        [1.0, 2.0, 4.0, -2.0]
    );
    // Ignoring 1: counted [2, 1, 3].
    assert_eq!(
        ignoring(Some(1), &prompt, &output, &row),
        [1.0, 2.0, 2.0, -2.0]
    );
    // Ignoring 3 (the whole prompt): counted [3].
    assert_eq!(
        ignoring(Some(3), &prompt, &output, &row),
        [1.0, 4.0, 4.0, -2.0]
    );
    // Ignoring 4 reaches into the output: nothing counted.
    assert_eq!(ignoring(Some(4), &prompt, &output, &row), row);
    // 0 and absent count everything.
    let all = [1.0, 2.0, 2.0, -2.0];
    assert_eq!(ignoring(Some(0), &prompt, &output, &row), all);
    assert_eq!(ignoring(None, &prompt, &output, &row), all);
    // Across the boundary: [1, 2 | 2, 3], ignoring 3: the output's 2 (index 2) is ignored
    // too, only 3 counts.
    assert_eq!(
        ignoring(Some(3), &[1, 2], &[2, 3], &row),
        [1.0, 4.0, 4.0, -2.0]
    );
}

#[test]
fn prompt_ignore_length_state_resets_and_clones() {
    let mut p = RepetitionPenalty::new(2.0)
        .unwrap()
        .with_prompt_ignore_length(2);
    assert_eq!(p.prompt_ignore_length(), Some(2));
    p.reset(&[1, 2]); // both ignored
    p.accept(3); // index 2: counted
    let mut q = p.clone();
    q.accept(1);
    p.accept(2);
    let row = [1.0f32; 4];
    let ctx = ProcessorContext::default();
    assert_eq!(applied(&mut p, &row, &ctx), [1.0, 1.0, 0.5, 0.5]);
    assert_eq!(applied(&mut q, &row, &ctx), [1.0, 0.5, 1.0, 0.5]);
    // A boxed clone keeps the count of ids seen: the next accepted id is counted.
    let mut boxed: Box<dyn LogitsProcessor> = Box::new(
        RepetitionPenalty::new(2.0)
            .unwrap()
            .with_prompt_ignore_length(3),
    );
    boxed.reset(&[0, 1]);
    boxed.accept(2); // index 2: ignored
    let mut copy = boxed.clone();
    copy.accept(0); // index 3: counted
    assert_eq!(applied(copy.as_mut(), &row, &ctx), [0.5, 1.0, 1.0, 1.0]);
    assert_eq!(applied(boxed.as_mut(), &row, &ctx), row);
    // reset starts the count again.
    boxed.reset(&[3, 3, 3, 1]);
    assert_eq!(applied(boxed.as_mut(), &row, &ctx), [1.0, 0.5, 1.0, 1.0]);
}

#[test]
fn repetition_penalties_equal_the_oracle_on_random_rows() {
    let mut g = SplitMix(0x004e_9ea7);
    for &vocab in &VOCABS {
        for _ in 0..40 {
            let row = random_row(&mut g, vocab);
            let prompt = random_ids(&mut g, vocab, 6);
            let output = random_ids(&mut g, vocab, 6);
            let full: Vec<u32> = prompt.iter().chain(&output).copied().collect();
            let r = 0.5 + g.next_f64() * 2.0;
            let ignore = g.below(9) as usize;
            // Hugging Face: the ids of input_ids[ignore:], each distinct id once.
            let counted: BTreeSet<u32> = full.iter().skip(ignore).copied().collect();
            let want: Vec<f64> = (0..vocab)
                .map(|i| {
                    let l = f64::from(row[i]);
                    match counted.contains(&(i as u32)) {
                        true if l > 0.0 => l / r,
                        true => l * r,
                        false => l,
                    }
                })
                .collect();
            let mut p = RepetitionPenalty::new(r)
                .unwrap()
                .with_prompt_ignore_length(ignore);
            p.reset(&prompt);
            output.iter().for_each(|&t| p.accept(t));
            let got = applied(&mut p, &row, &ProcessorContext::default());
            assert_row(&got, &want, &format!("ignore {ignore}"));

            // Encoder: 1 / r on the distinct prompt ids (the generated ones do not count):
            // l < 0 ? l * (1 / r) : l / (1 / r).
            let encoder: HashSet<u32> = prompt.iter().copied().collect();
            let want: Vec<f64> = (0..vocab)
                .map(|i| {
                    let l = f64::from(row[i]);
                    match encoder.contains(&(i as u32)) {
                        true if l < 0.0 => l / r,
                        true => l * r,
                        false => l,
                    }
                })
                .collect();
            let mut p = EncoderRepetitionPenalty::new(r).unwrap();
            p.reset(&prompt);
            output.iter().for_each(|&t| p.accept(t));
            let got = applied(&mut p, &row, &ProcessorContext::default());
            assert_row(&got, &want, "encoder repetition penalty");
        }
    }
}

#[test]
fn encoder_repetition_penalty_worked_cases() {
    // Penalty 2 -> factor 1/2 on the prompt ids {1, 2, 3}: l1 = 2 / 0.5 = 4, l2 = 0 / 0.5 = 0,
    // l3 = -3 * 0.5 = -1.5; l0 (generated only) unchanged; a -inf stays -inf.
    let row = [1.0f32, 2.0, 0.0, -3.0, NEG];
    let mut p = EncoderRepetitionPenalty::new(2.0).unwrap();
    p.reset(&[1, 3, 1, 2, 4]);
    p.accept(0);
    assert_eq!(p.encoder_ids(), &[1, 2, 3, 4]);
    let ctx = ProcessorContext::default();
    assert_eq!(applied(&mut p, &row, &ctx), [1.0, 4.0, 0.0, -1.5, NEG]);
    // Penalty 0.5 -> factor 2: l1 = 2 / 2 = 1, l3 = -3 * 2 = -6.
    let mut q = EncoderRepetitionPenalty::new(0.5).unwrap();
    q.reset(&[1, 3]);
    assert_eq!(applied(&mut q, &row, &ctx), [1.0, 1.0, 0.0, -6.0, NEG]);
    // Clone keeps the ids; a reset of the original does not touch the clone.
    let mut c = q.clone();
    q.reset(&[0]);
    assert_eq!(applied(&mut c, &row, &ctx), [1.0, 1.0, 0.0, -6.0, NEG]);
    assert_eq!(applied(&mut q, &row, &ctx), [0.5, 2.0, 0.0, -3.0, NEG]);
    // 1 is off.
    let mut off = EncoderRepetitionPenalty::new(1.0).unwrap();
    off.reset(&[0, 1, 2, 3]);
    assert_eq!(applied(&mut off, &row, &ctx), row);
    // Overflow: 3e38 / (1 / 4) leaves the f32 range; the row is left as it was.
    let mut big = EncoderRepetitionPenalty::new(4.0).unwrap();
    big.reset(&[0]);
    let mut r = [3e38f32, 1.0];
    assert_eq!(
        big.apply(&mut r, &ctx).unwrap_err(),
        SampleError::ProcessorOverflow {
            processor: "encoder_repetition_penalty",
            token_id: 0,
            logit: 3e38
        }
    );
    assert_eq!(r, [3e38, 1.0]);
}

// ---------------------------------------------------------------------------------------------
// InfNanRemove
// ---------------------------------------------------------------------------------------------

#[test]
fn inf_nan_remove_replaces_each_kind() {
    let mut p = InfNanRemove::new();
    assert!(p.accepts_non_finite());
    let ctx = ProcessorContext::default();
    let out = applied(
        &mut p,
        &[f32::NAN, f32::INFINITY, NEG, 1.5, -0.25, f32::MAX],
        &ctx,
    );
    assert_eq!(out, [0.0, f32::MAX, f32::MIN, 1.5, -0.25, f32::MAX]);

    // Oracle on random rows with every kind.
    let mut g = SplitMix(0x001a_f4a4);
    for &vocab in &VOCABS {
        let row: Vec<f32> = (0..vocab)
            .map(|_| match g.below(8) {
                0 => f32::NAN,
                1 => f32::INFINITY,
                2 => NEG,
                _ => (g.normal() * 5.0) as f32,
            })
            .collect();
        let want: Vec<f32> = row
            .iter()
            .map(|&l| {
                if l.is_nan() {
                    0.0
                } else if l == f32::INFINITY {
                    f32::MAX
                } else if l == NEG {
                    f32::MIN
                } else {
                    l
                }
            })
            .collect();
        assert_eq!(applied(&mut p, &row, &ctx), want);
    }
}

fn chain(json: &str) -> SamplerChain {
    let config: Vec<ProcessorConfig> = serde_json::from_str(json).unwrap();
    SamplerChain::from_config(&config).unwrap()
}

#[test]
fn inf_nan_remove_leading_a_chain_samples_non_finite_rows() {
    let with = r#"[{"inf_nan_remove": {}}, {"suppress_tokens": {"suppress_tokens": [4]}},
                   {"sample": {"seed": 7}}]"#;
    let without = r#"[{"suppress_tokens": {"suppress_tokens": [4]}}, {"sample": {"seed": 7}}]"#;
    let ctx = ProcessorContext::default();
    // NaN -> 0, +inf -> MAX, -inf -> MIN: token 2 takes all the mass (exp(l - MAX) = 0 for
    // every other l).
    let row = [f32::NAN, 1.0, f32::INFINITY, NEG, 3.0];
    let mut c = chain(with);
    assert_eq!(c.sample(&row, &ctx, 0).unwrap().token, 2);
    assert_close(
        &c.distribution(&row, &ctx).unwrap(),
        &[0.0, 0.0, 1.0, 0.0, 0.0],
        0.0,
        "+inf wins",
    );
    // The same chain without it: the row check's typed error (lowest id, the NaN).
    match chain(without).sample(&row, &ctx, 0).unwrap_err() {
        SampleError::NonFiniteLogits { token_id: 0, value } => assert!(value.is_nan()),
        other => panic!("{other:?}"),
    }
    // NaN and a finite logit: [NaN, ln 3, -inf] -> [0, ln 3, MIN]: p = [1/4, 3/4, 0].
    let row = [f32::NAN, 3f32.ln(), NEG];
    let d = chain(with.replace("[4]", "[]").as_str())
        .distribution(&row, &ctx)
        .unwrap();
    assert_close(&d, &[0.25, 0.75, 0.0], 1e-6, "NaN as 0");
    // Every logit -inf: all MIN, uniform (the chain without it: no candidate).
    let row = [NEG; 4];
    let d = chain(with.replace("[4]", "[]").as_str())
        .distribution(&row, &ctx)
        .unwrap();
    assert_close(&d, &[0.25; 4], 1e-12, "uniform");
    assert_eq!(
        chain(without.replace("[4]", "[]").as_str())
            .distribution(&row, &ctx)
            .unwrap_err(),
        SampleError::NoCandidates
    );
    // The bitmask comes after it: masking the +inf token 2 leaves [0, 1] (NaN -> 0, 1; the
    // MIN of token 3 has weight 0): p = [1 / (1 + e), e / (1 + e), 0, 0, 0].
    let row = [f32::NAN, 1.0, f32::INFINITY, NEG, 3.0];
    let mask = [0b0_1011u32]; // tokens 0, 1, 3 allowed; 2 and 4 masked
    let masked = ProcessorContext::default().with_token_bitmask(&mask);
    let e = std::f64::consts::E;
    let d = chain(with).distribution(&row, &masked).unwrap();
    assert_close(
        &d,
        &[1.0 / (1.0 + e), e / (1.0 + e), 0.0, 0.0, 0.0],
        1e-6,
        "masked after",
    );
}

#[test]
fn inf_nan_remove_elsewhere_sees_a_checked_row() {
    // Not leading: the row check comes first, so NaN is still an error.
    let c = r#"[{"suppress_tokens": {"suppress_tokens": []}}, {"inf_nan_remove": {}},
               {"sample": {"seed": 1}}]"#;
    let ctx = ProcessorContext::default();
    assert!(matches!(
        chain(c).sample(&[1.0, f32::NAN], &ctx, 0),
        Err(SampleError::NonFiniteLogits { token_id: 1, .. })
    ));
    // After suppress_tokens [0, 1, 2] it turns their -inf into MIN: weight 0 next to token 3,
    // and a uniform row when every token was removed.
    let c = r#"[{"suppress_tokens": {"suppress_tokens": [0, 1, 2]}}, {"inf_nan_remove": {}},
               {"sample": {"seed": 1}}]"#;
    let d = chain(c).distribution(&[1.0, 2.0, 3.0, 0.0], &ctx).unwrap();
    assert_close(&d, &[0.0, 0.0, 0.0, 1.0], 0.0, "MIN next to a finite logit");
    let d = chain(c).distribution(&[1.0, 2.0, 3.0], &ctx).unwrap();
    assert_close(&d, &[1.0 / 3.0; 3], 1e-12, "every token removed");
}

// ---------------------------------------------------------------------------------------------
// Validation, id checks, configuration
// ---------------------------------------------------------------------------------------------

#[test]
fn parameter_errors_name_the_field() {
    let field = |r: Result<(), nucleus_sampling::ParamError>| r.unwrap_err().field;
    let seq = |e: Vec<(Vec<u32>, f64)>| field(SequenceBias::new(e).map(drop));
    assert_eq!(seq(vec![]), "sequence_bias");
    assert_eq!(seq(vec![(vec![1], 1.0), (vec![], 1.0)]), "sequence_bias");
    assert_eq!(seq(vec![(vec![1], f64::NAN)]), "sequence_bias");
    assert_eq!(seq(vec![(vec![1], f64::INFINITY)]), "sequence_bias");
    // Finite in f64, infinite in f32 (Hugging Face's biases are f32).
    assert_eq!(seq(vec![(vec![1], 1e39)]), "sequence_bias");
    // Token id 0 is accepted (Hugging Face's list form rejects it by a slip).
    assert!(SequenceBias::new(vec![(vec![0, 0], -1.0)]).is_ok());

    assert_eq!(field(ForcedEos::new(0, vec![1]).map(drop)), "max_length");
    assert_eq!(field(ForcedEos::new(5, vec![]).map(drop)), "eos_token_id");
    let decay = |f: f64, ids: Option<Vec<u32>>| {
        field(ExponentialDecayLengthPenalty::new(3, f, ids).map(drop))
    };
    assert_eq!(decay(f64::NAN, None), "decay_factor");
    assert_eq!(decay(f64::INFINITY, None), "decay_factor");
    assert_eq!(decay(f64::NEG_INFINITY, Some(vec![1])), "decay_factor");
    assert_eq!(decay(1.5, Some(vec![])), "eos_token_id");
    for p in [0.0, -1.0, f64::NAN, f64::INFINITY] {
        assert_eq!(
            field(EncoderRepetitionPenalty::new(p).map(drop)),
            "encoder_repetition_penalty"
        );
    }
    // Through the JSON configuration: InvalidParams naming the field.
    let cases = [
        (
            r#"{"sequence_bias": {"sequence_bias": []}}"#,
            "sequence_bias",
        ),
        (
            r#"{"sequence_bias": {"sequence_bias": [[[1], "nan"]]}}"#,
            "sequence_bias",
        ),
        (
            r#"{"forced_eos_token": {"max_length": 0, "eos_token_id": 1}}"#,
            "max_length",
        ),
        (
            r#"{"forced_eos_token": {"max_length": 3, "eos_token_id": []}}"#,
            "eos_token_id",
        ),
        (
            r#"{"exponential_decay_length_penalty": {"start_index": 1, "decay_factor": "inf"}}"#,
            "decay_factor",
        ),
        (
            r#"{"encoder_repetition_penalty": {"penalty": 0}}"#,
            "encoder_repetition_penalty",
        ),
        (
            r#"{"repetition_penalty": {"penalty": -1, "prompt_ignore_length": 3}}"#,
            "repetition_penalty",
        ),
    ];
    for (entry, field) in cases {
        let config: Vec<ProcessorConfig> =
            serde_json::from_str(&format!(r#"[{entry}, {{"greedy": {{}}}}]"#))
                .unwrap_or_else(|e| panic!("{entry}: {e}"));
        match SamplerChain::from_config(&config) {
            Err(ChainError::InvalidParams {
                index: 0, source, ..
            }) => assert_eq!(source.field, field, "{entry}"),
            other => panic!("{entry}: {other:?}"),
        }
    }
}

#[test]
fn held_token_ids_are_checked_against_the_vocabulary() {
    let cases: [(Box<dyn LogitsProcessor>, &str); 6] = [
        (
            Box::new(SequenceBias::new(vec![(vec![9, 1], 1.0)]).unwrap()),
            "sequence_bias",
        ),
        (Box::new(ForcedBos::new(4)), "bos_token_id"),
        (
            Box::new(ForcedEos::new(9, vec![1, 7]).unwrap()),
            "eos_token_id",
        ),
        (Box::new(SuppressTokens::new(vec![4])), "suppress_tokens"),
        (
            Box::new(SuppressTokensAtBegin::new(vec![0, 5], 3)),
            "begin_suppress_tokens",
        ),
        (
            Box::new(ExponentialDecayLengthPenalty::new(9, 1.1, Some(vec![6])).unwrap()),
            "eos_token_id",
        ),
    ];
    for (p, field) in cases {
        let name = p.name().to_string();
        let mut c = SamplerChain::new(Selection::greedy());
        c.push_boxed(p);
        match c.sample(&[0.0; 4], &ProcessorContext::default(), 0) {
            Err(SampleError::TokenIdOutOfRange {
                field: f,
                vocab_size: 4,
                ..
            }) => assert_eq!(f, field, "{name}"),
            other => panic!("{name}: {other:?}"),
        }
    }
    // The encoder ids are the prompt's.
    let mut p = EncoderRepetitionPenalty::new(2.0).unwrap();
    p.reset(&[1, 8]);
    assert!(matches!(
        p.check_ids(4),
        Err(SampleError::TokenIdOutOfRange {
            field: "prompt_ids",
            token_id: 8,
            ..
        })
    ));
}

const CONFIG: &str = r#"[
    {"inf_nan_remove": {}},
    {"sequence_bias": {"sequence_bias": [[[1, 2], -1.5], [[3], 0.5]]}},
    {"forced_bos_token": {"bos_token_id": 0}},
    {"forced_eos_token": {"max_length": 9, "eos_token_id": 5}},
    {"suppress_tokens": {"suppress_tokens": [6]}},
    {"suppress_tokens_at_begin": {"begin_suppress_tokens": [5], "begin_index": 1}},
    {"exponential_decay_length_penalty": {"start_index": 2, "decay_factor": 1.25}},
    {"repetition_penalty": {"penalty": 1.1, "prompt_ignore_length": 2}},
    {"repetition_penalty": {"penalty": 1.2}},
    {"encoder_repetition_penalty": {"penalty": 1.3}},
    {"greedy": {}}
]"#;

#[test]
fn configuration_round_trips_and_builds_the_processors() {
    let config: Vec<ProcessorConfig> = serde_json::from_str(CONFIG).unwrap();
    assert_eq!(
        config[1],
        ProcessorConfig::SequenceBias {
            sequence_bias: vec![(vec![1, 2], -1.5), (vec![3], 0.5)]
        }
    );
    // An eos id alone reads as a list.
    assert_eq!(
        config[3],
        ProcessorConfig::ForcedEosToken {
            max_length: 9,
            eos_token_id: vec![5]
        }
    );
    assert_eq!(
        config[6],
        ProcessorConfig::ExponentialDecayLengthPenalty {
            start_index: 2,
            decay_factor: 1.25,
            eos_token_id: None
        }
    );
    let text = serde_json::to_string(&config).unwrap();
    let again: Vec<ProcessorConfig> = serde_json::from_str(&text).unwrap();
    assert_eq!(again, config);
    // The existing form round trips unchanged: no prompt_ignore_length when absent.
    assert!(
        text.contains(r#"{"repetition_penalty":{"penalty":1.2}}"#),
        "{text}"
    );
    assert!(text.contains(r#""prompt_ignore_length":2"#), "{text}");
    assert!(text.contains(r#"{"inf_nan_remove":{}}"#), "{text}");
    assert!(text.contains(r#""eos_token_id":[5]"#), "{text}");
    assert!(
        text.contains(
            r#"{"exponential_decay_length_penalty":{"start_index":2,"decay_factor":1.25}}"#
        ),
        "{text}"
    );

    let chain = SamplerChain::from_config(&config).unwrap();
    let names: Vec<&str> = chain.processors().iter().map(|p| p.name()).collect();
    assert_eq!(
        names,
        [
            "inf_nan_remove",
            "sequence_bias",
            "forced_bos_token",
            "forced_eos_token",
            "suppress_tokens",
            "suppress_tokens_at_begin",
            "exponential_decay_length_penalty",
            "repetition_penalty",
            "repetition_penalty",
            "encoder_repetition_penalty"
        ]
    );
    let config_names: Vec<&str> = config.iter().map(|c| c.name()).collect();
    assert_eq!(config_names[..names.len()], names);

    // Unknown fields are rejected.
    for bad in [
        r#"[{"inf_nan_remove": {"x": 1}}, {"greedy": {}}]"#,
        r#"[{"forced_bos_token": {"bos": 1}}, {"greedy": {}}]"#,
        r#"[{"sequence_bias": {"sequence_bias": [[1, 2]]}}, {"greedy": {}}]"#,
    ] {
        assert!(
            serde_json::from_str::<Vec<ProcessorConfig>>(bad).is_err(),
            "{bad}"
        );
    }
}

#[test]
fn a_configured_chain_forces_then_suppresses_through_a_generation() {
    // forced_bos 0 at step 0, suppress 5 at step 1 (begin_index 1), forced eos 5 when
    // prompt (2) + output reach max_length - 1 = 5, i.e. at 3 generated; greedy otherwise
    // picks token 5 (the largest logit) unless suppressed. Suppress [6] always.
    let json = r#"[
        {"forced_bos_token": {"bos_token_id": 0}},
        {"suppress_tokens": {"suppress_tokens": [6]}},
        {"suppress_tokens_at_begin": {"begin_suppress_tokens": [5], "begin_index": 1}},
        {"forced_eos_token": {"max_length": 6, "eos_token_id": [5]}},
        {"greedy": {}}
    ]"#;
    let mut c = chain(json);
    let prompt = [1u32, 2];
    c.reset(&prompt);
    let row = [0.0f32, 1.0, 2.0, 3.0, 4.0, 5.0, 9.0];
    let mut output = Vec::new();
    // Step 0: forced 0. Step 1: 5 suppressed at begin, 6 always: 4. Step 2: 5. Step 3: total
    // 5 = max_length - 1: forced 5.
    for want in [0u32, 4, 5, 5] {
        let ctx = ProcessorContext::new(&prompt, &output, (prompt.len() + output.len()) as u64);
        let token = c.sample(&row, &ctx, 0).unwrap().token;
        assert_eq!(token, want, "after {output:?}");
        c.accept(token);
        output.push(token);
    }
}
