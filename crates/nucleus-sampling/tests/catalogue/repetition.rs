//! Repetition avoidance (`chain/repetition.rs`): DRY (llama.cpp `llama_sampler_dry_*`), its
//! string-breaker resolver (`get_overlapping_token_sequences`), no-repeat-n-gram and
//! encoder-no-repeat-n-gram (Hugging Face `logits_process.py`).
//!
//! Expected values are worked by hand from the anchors' documented semantics (the arithmetic is
//! in the comments) or come from the slow oracles written below from the definitions, never
//! from running the implementation.

use crate::common;

use std::cell::Cell;
use std::collections::BTreeSet;

use common::stats::chi_square_test;
use common::SplitMix;
use nucleus_sampling::chain::{
    resolve_sequence_breakers, ChainError, Dry, EncoderNoRepeatNGram, LogitsProcessor,
    NoRepeatNGram, ProcessorConfig, ProcessorContext, SamplerChain, Selection, Temperature,
    DRY_DEFAULT_SEQUENCE_BREAKERS,
};
use nucleus_sampling::SampleError;

const NEG: f32 = f32::NEG_INFINITY;

fn ctx0() -> ProcessorContext<'static> {
    ProcessorContext::default()
}

fn dry(mult: f64, base: f64, allowed: i64, last_n: i64, breakers: &[&[u32]]) -> Dry {
    Dry::new(
        mult,
        base,
        allowed,
        last_n,
        breakers.iter().map(|b| b.to_vec()).collect(),
    )
    .unwrap()
}

/// Applies `p` after `reset(history)` to a copy of `logits`.
fn after_reset(p: &mut dyn LogitsProcessor, history: &[u32], logits: &[f32]) -> Vec<f32> {
    p.reset(history);
    applied(p, logits)
}

fn applied(p: &mut dyn LogitsProcessor, logits: &[f32]) -> Vec<f32> {
    let mut row = logits.to_vec();
    p.apply(&mut row, &ctx0()).unwrap();
    row
}

#[track_caller]
fn assert_row(got: &[f32], want: &[f64], what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        let ok = if w == f64::NEG_INFINITY {
            g == NEG
        } else {
            (f64::from(g) - w).abs() <= 1e-5 * w.abs().max(1.0)
        };
        assert!(
            ok,
            "{what}: entry {i}: got {g}, want {w}\n got  {got:?}\n want {want:?}"
        );
    }
}

// ---------------------------------------------------------------------------------------------
// DRY: hand-worked tables
// ---------------------------------------------------------------------------------------------

/// History `1 2 3 4 1 2 3`: the suffix `1 2 3` occurred before, followed by 4.
const H: [u32; 7] = [1, 2, 3, 4, 1, 2, 3];
const L6: [f32; 6] = [0.5, 1.0, -1.0, 2.0, 0.25, 3.0];

#[test]
fn dry_penalises_the_token_that_extends_a_repeat() {
    // Repeat length 3 (w[0..=2] = 1 2 3 = the suffix), continuation w[3] = 4. No other earlier
    // position ends with the last token 3, so only token 4 is penalised.
    // allowed 2: 0.8 * 1.75^(3-2) = 1.4 -> 0.25 - 1.4 = -1.15.
    let got = after_reset(&mut dry(0.8, 1.75, 2, -1, &[]), &H, &L6);
    assert_row(&got, &[0.5, 1.0, -1.0, 2.0, -1.15, 3.0], "allowed 2");
    // allowed 3: 0.8 * 1.75^0 = 0.8 -> -0.55.
    let got = after_reset(&mut dry(0.8, 1.75, 3, -1, &[]), &H, &L6);
    assert_row(&got, &[0.5, 1.0, -1.0, 2.0, -0.55, 3.0], "allowed 3");
    // allowed 4: 3 < 4, nothing.
    let got = after_reset(&mut dry(0.8, 1.75, 4, -1, &[]), &H, &L6);
    assert_row(&got, &[0.5, 1.0, -1.0, 2.0, 0.25, 3.0], "allowed 4");
    // allowed 1: exponent 2: 0.8 * 3.0625 = 2.45 -> 0.25 - 2.45 = -2.2.
    let got = after_reset(&mut dry(0.8, 1.75, 1, -1, &[]), &H, &L6);
    assert_row(&got, &[0.5, 1.0, -1.0, 2.0, -2.2, 3.0], "allowed 1");
    // allowed 0: every earlier position counts, with its (possibly 0) match length:
    // j=0 -> token 2 (len 0), j=1 -> 3 (0), j=2 -> 4 (3), j=3 -> 1 (0), j=4 -> 2 (0),
    // j=5 -> 3 (0). Tokens 1, 2, 3: 0.8 * 1.75^0 = 0.8; token 4: 0.8 * 1.75^3 = 4.2875.
    let got = after_reset(&mut dry(0.8, 1.75, 0, -1, &[]), &H, &L6);
    assert_row(&got, &[0.5, 0.2, -1.8, 1.2, -4.0375, 3.0], "allowed 0");
    // multiplier 2, base 3, allowed 2: 2 * 3^1 = 6 -> -5.75.
    let got = after_reset(&mut dry(2.0, 3.0, 2, -1, &[]), &H, &L6);
    assert_row(&got, &[0.5, 1.0, -1.0, 2.0, -5.75, 3.0], "base 3");
}

#[test]
fn dry_is_off_with_multiplier_zero_or_penalty_last_n_zero() {
    for d in [dry(0.0, 1.75, 2, -1, &[]), dry(0.8, 1.75, 2, 0, &[])] {
        let mut d = d;
        assert!(!d.is_enabled());
        assert_eq!(after_reset(&mut d, &H, &L6), L6.to_vec());
        assert!(d.window().is_empty(), "nothing is stored when off");
    }
    // A history no longer than allowed_length: nothing ([1, 1]: length 2 <= 2).
    let got = after_reset(&mut dry(0.8, 1.75, 2, -1, &[]), &[1, 1], &L6);
    assert_eq!(got, L6.to_vec());
}

#[test]
fn dry_sequence_breakers_limit_the_match() {
    let base = [0.5, 1.0, -1.0, 2.0, -1.15, 3.0]; // the unbroken result (see above)
    let unchanged = L6.map(f64::from);
    type Case<'a> = (&'a [&'a [u32]], [f64; 6], &'a str);
    let cases: [Case; 8] = [
        // [2] at position 5: 7 - 5 - 1 = 1 token after it; 1 < 2: nothing.
        (&[&[2]], unchanged, "[2] near the end"),
        // [3] is the last token: 0 tokens after it.
        (&[&[3]], unchanged, "[3] last"),
        // [2, 3] at 5..7: 0 tokens after it.
        (&[&[2, 3]], unchanged, "[2, 3] last"),
        // [1, 5] never matches (1 is followed by 2): no limit.
        (&[&[1, 5]], base, "[1, 5] no match"),
        // [4] at position 3: 7 - 3 - 1 = 3 tokens after it, so the repeat 1 2 3 fits, but its
        // continuation 4 is itself a single-token breaker: exempt, nothing.
        (&[&[4]], unchanged, "[4] exempt"),
        // [3, 4] at 2..4 (the most recent head 3 at 6 has no room for its tail): 3 after it.
        (&[&[3, 4]], base, "[3, 4]"),
        // [4, 1] at 3..5: 7 - 3 - 2 = 2 tokens after it, the repeat is cut to 2:
        // 0.8 * 1.75^0 = 0.8 -> 0.25 - 0.8 = -0.55.
        (
            &[&[4, 1]],
            [0.5, 1.0, -1.0, 2.0, -0.55, 3.0],
            "[4, 1] cuts to 2",
        ),
        // Two breakers with the head 4 at position 3: [4, 1] and [4, 1, 2] both match; the
        // longest wins: 7 - 3 - 3 = 1 token after it, 1 < 2: nothing.
        (&[&[4, 1], &[4, 1, 2]], unchanged, "longest at the head"),
    ];
    for (breakers, want, what) in cases {
        let got = after_reset(&mut dry(0.8, 1.75, 2, -1, breakers), &H, &L6);
        assert_row(&got, &want, what);
    }

    // A breaker inside the match: 7 1 2 3 4 7 1 2 3. Unbroken, the repeat 7 1 2 3 has length
    // 4: 0.8 * 1.75^2 = 2.45 on token 4. With the breaker [1] at position 6 only 2 tokens
    // follow it: length 2, 0.8 * 1.75^0 = 0.8.
    let h = [7u32, 1, 2, 3, 4, 7, 1, 2, 3];
    let zeros = [0.0f32; 8];
    let mut want = [0.0f64; 8];
    want[4] = -2.45;
    let got = after_reset(&mut dry(0.8, 1.75, 2, -1, &[]), &h, &zeros);
    assert_row(&got, &want, "unbroken length 4");
    want[4] = -0.8;
    let got = after_reset(&mut dry(0.8, 1.75, 2, -1, &[&[1]]), &h, &zeros);
    assert_row(&got, &want, "breaker inside the match");
}

#[test]
fn dry_does_not_penalise_a_single_token_breaker() {
    // 1 2 9 1 2: the repeat 1 2 (length 2) is followed by 9.
    let h = [1u32, 2, 9, 1, 2];
    let zeros = [0.0f32; 10];
    let mut want = [0.0f64; 10];
    want[9] = -0.8; // no breakers: 0.8 * 1.75^0
    assert_row(
        &after_reset(&mut dry(0.8, 1.75, 2, -1, &[]), &h, &zeros),
        &want,
        "no breakers",
    );
    // [9] is a single-token breaker: 2 tokens follow it (the repeat keeps length 2), but 9
    // itself is exempt (newer llama.cpp).
    assert_row(
        &after_reset(&mut dry(0.8, 1.75, 2, -1, &[&[9]]), &h, &zeros),
        &[0.0; 10],
        "[9] exempt",
    );
    // [9, 5] starts with 9 but is not a single-token breaker (and never matches): 9 penalised.
    assert_row(
        &after_reset(&mut dry(0.8, 1.75, 2, -1, &[&[9, 5]]), &h, &zeros),
        &want,
        "[9, 5] not exempt",
    );
}

#[test]
fn dry_penalty_last_n_cuts_the_history() {
    // Window 7: the whole history, 1.4 on token 4.
    let w7 = [0.5, 1.0, -1.0, 2.0, -1.15, 3.0];
    // Window 6 = 2 3 4 1 2 3: the repeat is 2 3 (length 2), 0.8 -> 0.25 - 0.8 = -0.55.
    let w6 = [0.5, 1.0, -1.0, 2.0, -0.55, 3.0];
    // Window 4 = 4 1 2 3: no earlier 3.
    let w4 = L6.map(f64::from);
    for (last_n, want) in [(7, w7), (8, w7), (6, w6), (4, w4)] {
        let mut d = dry(0.8, 1.75, 2, last_n, &[]);
        assert_row(
            &after_reset(&mut d, &H, &L6),
            &want,
            &format!("last {last_n}"),
        );
        // The same sequence learnt through accept, with a shorter prompt.
        d.reset(&H[..2]);
        for &t in &H[2..] {
            d.accept(t);
        }
        assert_row(
            &applied(&mut d, &L6),
            &want,
            &format!("accepted, last {last_n}"),
        );
        let n = (last_n as usize).min(H.len());
        assert_eq!(d.window(), &H[H.len() - n..]);
    }
    // The buffer stays bounded: 1000 accepted tokens, window 3.
    let mut d = dry(0.8, 1.75, 2, 3, &[]);
    d.reset(&[5; 50]);
    for i in 0..1000u32 {
        d.accept(i % 7);
    }
    assert_eq!(d.window(), &[3, 4, 5]); // 997 % 7, 998 % 7, 999 % 7 (994 = 7 * 142)
}

#[test]
fn dry_max_exponent_clamp_on_a_huge_repeat() {
    // 200 times token 1: the earlier run w[0..=198] (199 ones) matches the suffix, length 199,
    // continuation 1. Exponent 199 - 2 = 197; base 1.75: max_exponent = trunc(88.7228391 /
    // ln 1.75) = trunc(158.54) = 158, so the penalty is m * 1.75^158 (about m * 2.51e38).
    let h = [1u32; 200];
    let row = [0.0f32; 3];
    let got = after_reset(&mut dry(1e-3, 1.75, 2, -1, &[]), &h, &row);
    assert_row(&got, &[0.0, -(1e-3 * 1.75f64.powi(158)), 0.0], "clamped");
    // Multiplier 2: 2 * 2.51e38 = 5.0e38 > f32::MAX: the logit becomes -inf (removed).
    let got = after_reset(&mut dry(2.0, 1.75, 2, -1, &[]), &h, &row);
    assert_eq!(got, [0.0, NEG, 0.0]);
    // Base 1e10: max_exponent = trunc(88.7228391 / 23.0258509) = trunc(3.853) = 3, so ten ones
    // (length 9, exponent 7) get 1e-30 * 1e10^3 = 1.
    let got = after_reset(&mut dry(1e-30, 1e10, 2, -1, &[]), &[1; 10], &row);
    assert_row(&got, &[0.0, -1.0, 0.0], "base 1e10");
    // Base 1: no clamp, base^e = 1: penalty = multiplier.
    let got = after_reset(&mut dry(0.5, 1.0, 2, -1, &[]), &h, &row);
    assert_row(&got, &[0.0, -0.5, 0.0], "base 1");
    // Base 1.000001 (not > 1.000001 in f32): no clamp; 1.000001^197 = 1.000197...
    let got = after_reset(&mut dry(0.5, 1.000001, 2, -1, &[]), &h, &row);
    assert_row(
        &got,
        &[0.0, -0.5 * 1.000001f64.powi(197), 0.0],
        "base 1.000001",
    );
    // -inf stays -inf.
    let got = after_reset(&mut dry(0.5, 1.0, 2, -1, &[]), &h, &[0.0, NEG, 0.0]);
    assert_eq!(got, [0.0, NEG, 0.0]);
}

#[test]
fn dry_before_or_after_temperature_differs() {
    // Token 4's penalty is 1.4 on logits of 0. DRY then T=2: (0 - 1.4) / 2 = -0.7.
    // T=2 then DRY: 0 / 2 - 1.4 = -1.4.
    let row = [0.0f32; 6];
    let run = |dry_first: bool| {
        let mut chain = SamplerChain::new(Selection::sample(Some(1)));
        let d = dry(0.8, 1.75, 2, -1, &[]);
        let t = Temperature::new(2.0).unwrap();
        if dry_first {
            chain.push(d).push(t);
        } else {
            chain.push(t).push(d);
        }
        chain.reset(&H);
        chain.process(&row, &ctx0()).unwrap().to_vec()
    };
    assert_row(&run(true), &[0.0, 0.0, 0.0, 0.0, -0.7, 0.0], "dry first");
    assert_row(
        &run(false),
        &[0.0, 0.0, 0.0, 0.0, -1.4, 0.0],
        "temperature first",
    );
}

// ---------------------------------------------------------------------------------------------
// DRY: the oracle
// ---------------------------------------------------------------------------------------------

/// DRY from its definition, in f64: the window is the last `last_n` tokens (-1: all); the
/// restart limit is the number of tokens after the most recent breaker start (the longest
/// breaker there) lying wholly in the window; for each token t, the longest match length (capped
/// at the limit, at least `allowed`) over earlier positions j followed by t of the common suffix
/// of `w[..=j]` and `w`; single-token breakers exempt; exponent clamped to
/// trunc(88.7228391 / ln base) when base > 1.000001 and that is > 0.
fn dry_oracle(
    logits: &[f32],
    history: &[u32],
    (mult, base, allowed, last_n): (f64, f64, usize, i64),
    breakers: &[Vec<u32>],
) -> Vec<f64> {
    let mut out: Vec<f64> = logits.iter().map(|&l| f64::from(l)).collect();
    if mult == 0.0 || last_n == 0 {
        return out;
    }
    let n = if last_n < 0 {
        history.len()
    } else {
        history.len().min(last_n as usize)
    };
    let w = &history[history.len() - n..];
    let mut limit = n;
    for p in (0..n).rev() {
        let longest = breakers
            .iter()
            .filter(|b| p + b.len() <= n && w[p..p + b.len()] == b[..])
            .map(|b| b.len())
            .max();
        if let Some(m) = longest {
            limit = n - p - m;
            break;
        }
    }
    let cap = if base > 1.000001 {
        (88.7228391 / base.ln()).trunc()
    } else {
        0.0
    };
    for t in 0..logits.len() as u32 {
        if breakers.iter().any(|b| b == &[t]) {
            continue;
        }
        let mut best: Option<usize> = None;
        for j in 0..n.saturating_sub(1) {
            if w[j + 1] != t {
                continue;
            }
            let mut m = 0;
            while m <= j && w[j - m] == w[n - 1 - m] {
                m += 1;
            }
            let len = m.min(limit);
            if len >= allowed {
                best = Some(best.map_or(len, |b| b.max(len)));
            }
        }
        if let Some(len) = best {
            let mut e = (len - allowed) as f64;
            if cap > 0.0 && e > cap {
                e = cap;
            }
            out[t as usize] -= mult * base.powf(e);
        }
    }
    out
}

/// A random row: values in steps of 0.5 (ties), some -inf.
fn random_row(g: &mut SplitMix, vocab: usize) -> Vec<f32> {
    (0..vocab)
        .map(|_| {
            if g.below(6) == 0 {
                NEG
            } else {
                (g.below(9) as f32 - 4.0) * 0.5
            }
        })
        .collect()
}

#[test]
fn dry_matches_the_oracle_on_random_histories() {
    let mut g = SplitMix(0xD1);
    for case in 0..3000 {
        let vocab = [3usize, 5, 8, 40][case % 4];
        // History ids 0..alphabet (many repeats); breakers also use the id `alphabet`.
        let alphabet = (2 + g.below(3) as u32).min(vocab as u32 - 1);
        let len = g.below(60) as usize;
        let history: Vec<u32> = (0..len)
            .map(|_| g.below(u64::from(alphabet)) as u32)
            .collect();
        let breakers: Vec<Vec<u32>> = (0..g.below(4))
            .map(|_| {
                (0..1 + g.below(3))
                    .map(|_| g.below(u64::from(alphabet) + 1) as u32)
                    .collect()
            })
            .collect();
        let allowed = g.below(5) as usize;
        let last_n = match g.below(4) {
            0 => -1,
            1 => 0,
            _ => 1 + g.below(len as u64 + 3) as i64,
        };
        let (mult, base) = [
            (0.8, 1.75),
            (2.0, 3.0),
            (0.05, 1.0),
            (0.3, 1.000001),
            (1e-30, 1e10),
            (0.0, 1.75),
            (1.0, 1.3),
        ][g.below(7) as usize];
        let logits = random_row(&mut g, vocab);
        let want = dry_oracle(&logits, &history, (mult, base, allowed, last_n), &breakers);
        let what = format!(
            "case {case}: history {history:?}, breakers {breakers:?}, allowed {allowed}, \
             last_n {last_n}, mult {mult}, base {base}"
        );
        let mut d = Dry::new(mult, base, allowed as i64, last_n, breakers.clone()).unwrap();
        // Stateful: part of the history as the prompt, the rest accepted.
        let split = g.below(len as u64 + 1) as usize;
        d.reset(&history[..split]);
        for &t in &history[split..] {
            d.accept(t);
        }
        assert_row(&applied(&mut d, &logits), &want, &what);
        // Stateless, split elsewhere.
        let split = g.below(len as u64 + 1) as usize;
        let mut row = logits.clone();
        d.apply_to_sequence(&mut row, &history[..split], &history[split..])
            .unwrap();
        assert_row(&row, &want, &format!("{what} (apply_to_sequence)"));
    }
}

/// Chi-square of a sampling chain [DRY, temperature 0.9] against the oracle's distribution.
/// Alpha 1e-6: a correct implementation fails this test once in a million seeds.
#[test]
fn dry_chain_samples_the_oracle_distribution() {
    const ALPHA: f64 = 1e-6;
    const DRAWS: u64 = 40_000;
    // History 1 2 3 4 5 1 2 3 5 1 2 3: the suffix 1 2 3 was followed by 4 (length 3:
    // 0.8 * 1.75 = 1.4) and 5 1 2 3 by 5 (length 4: 0.8 * 1.75^2 = 2.45).
    let history = [1u32, 2, 3, 4, 5, 1, 2, 3, 5, 1, 2, 3];
    let logits = [0.3f32, -0.2, 0.1, 0.5, 0.8, 0.6];
    let pen = dry_oracle(&logits, &history, (0.8, 1.75, 2, -1), &[]);
    assert!((pen[4] - (0.8 - 1.4)).abs() < 1e-6 && (pen[5] - (0.6 - 2.45)).abs() < 1e-6);
    assert_eq!(
        &pen[..4],
        &logits[..4]
            .iter()
            .map(|&l| f64::from(l))
            .collect::<Vec<_>>()[..]
    );
    let w: Vec<f64> = pen.iter().map(|l| (l / 0.9).exp()).collect();
    let z: f64 = w.iter().sum();
    let probs: Vec<f64> = w.iter().map(|x| x / z).collect();

    let mut chain = SamplerChain::new(Selection::sample(Some(0x05EE_DD27)));
    chain
        .push(dry(0.8, 1.75, 2, -1, &[]))
        .push(Temperature::new(0.9).unwrap());
    chain.reset(&history);
    let d = chain.distribution(&logits, &ctx0()).unwrap();
    for (a, b) in d.iter().zip(&probs) {
        assert!(
            (a - b).abs() < 1e-6,
            "distribution {d:?} vs oracle {probs:?}"
        );
    }
    let mut counts = vec![0u64; logits.len()];
    for position in 0..DRAWS {
        let ctx = ProcessorContext::new(&[], &[], position);
        counts[chain.sample(&logits, &ctx, 0).unwrap().token as usize] += 1;
    }
    let chi = chi_square_test(&counts, &probs, ALPHA);
    assert_eq!(chi.outside_support, 0);
    assert!(
        chi.statistic < chi.critical,
        "chi-square {:.1} >= {:.1} (df {})",
        chi.statistic,
        chi.critical,
        chi.df
    );
}

// ---------------------------------------------------------------------------------------------
// DRY: parameters, ids, state
// ---------------------------------------------------------------------------------------------

#[test]
fn dry_parameter_errors_name_the_field() {
    let err =
        |m: f64, b: f64, a: i64, n: i64, s: Vec<Vec<u32>>| Dry::new(m, b, a, n, s).unwrap_err();
    for m in [-0.1, f64::NAN, f64::INFINITY] {
        assert_eq!(err(m, 1.75, 2, -1, vec![]).field, "dry_multiplier");
    }
    for b in [0.999, 0.0, f64::NAN, f64::INFINITY] {
        assert_eq!(err(0.8, b, 2, -1, vec![]).field, "dry_base");
    }
    assert_eq!(err(0.8, 1.75, -1, -1, vec![]).field, "dry_allowed_length");
    assert_eq!(err(0.8, 1.75, 2, -2, vec![]).field, "dry_penalty_last_n");
    assert_eq!(
        err(0.8, 1.75, 2, -1, vec![vec![]]).field,
        "dry_sequence_breakers"
    );
    assert_eq!(
        err(0.8, 1.75, 2, -1, vec![vec![1; 22]]).field,
        "dry_sequence_breakers"
    );
    // The boundaries themselves are valid.
    Dry::new(0.0, 1.0, 0, -1, vec![vec![1; 21], vec![2]]).unwrap();
    Dry::new(0.8, 1.75, 2, 0, vec![]).unwrap();
    // Breakers are kept sorted and deduplicated.
    let d = Dry::new(0.8, 1.75, 2, -1, vec![vec![5, 1], vec![2], vec![5, 1]]).unwrap();
    assert_eq!(d.sequence_breakers(), &[vec![2], vec![5, 1]]);
}

#[test]
fn dry_ids_are_checked_against_the_vocabulary() {
    let mut chain = SamplerChain::new(Selection::greedy());
    chain.push(dry(0.8, 1.75, 2, -1, &[&[7]]));
    let e = chain.sample(&[0.0; 5], &ctx0(), 0).unwrap_err();
    assert!(
        matches!(
            e,
            SampleError::TokenIdOutOfRange {
                field: "dry_sequence_breakers",
                token_id: 7,
                ..
            }
        ),
        "{e:?}"
    );
    let mut chain = SamplerChain::new(Selection::greedy());
    chain.push(dry(0.8, 1.75, 2, -1, &[]));
    chain.reset(&[1, 9]);
    let e = chain.sample(&[0.0; 5], &ctx0(), 0).unwrap_err();
    assert!(
        matches!(
            e,
            SampleError::TokenIdOutOfRange {
                field: "prompt_ids",
                token_id: 9,
                ..
            }
        ),
        "{e:?}"
    );
    chain.reset(&[1]);
    chain.accept(6);
    let e = chain.sample(&[0.0; 5], &ctx0(), 0).unwrap_err();
    assert!(
        matches!(
            e,
            SampleError::TokenIdOutOfRange {
                field: "output_ids",
                token_id: 6,
                ..
            }
        ),
        "{e:?}"
    );
}

#[test]
fn dry_reset_accept_and_clone() {
    let row = [0.0f32; 10];
    let mut d = dry(0.8, 1.75, 2, -1, &[]);
    d.reset(&[1, 2, 3, 4]);
    d.accept(1);
    d.accept(2);
    let mut c = d.clone();
    let mut boxed = d.box_clone();
    d.accept(3); // 1 2 3 4 1 2 3: token 4 gets 1.4
    c.accept(9); // 1 2 3 4 1 2 9: no earlier 9, nothing
    let mut want = [0.0f64; 10];
    want[4] = -1.4;
    assert_row(&applied(&mut d, &row), &want, "original");
    assert_row(&applied(&mut c, &row), &[0.0; 10], "clone");
    // The boxed clone still has 1 2 3 4 1 2: the repeat 1 2 (length 2) -> 3 gets 0.8.
    let mut want_boxed = [0.0f64; 10];
    want_boxed[3] = -0.8;
    assert_row(&applied(boxed.as_mut(), &row), &want_boxed, "boxed clone");
    // Reset forgets everything.
    d.reset(&[]);
    assert!(d.window().is_empty());
    assert_row(&applied(&mut d, &row), &[0.0; 10], "after reset");
    // Reset with a long prompt keeps its last penalty_last_n tokens.
    let mut d = dry(0.8, 1.75, 2, 4, &[]);
    d.reset(&[9, 8, 7, 6, 5, 4]);
    assert_eq!(d.window(), &[7, 6, 5, 4]);
}

// ---------------------------------------------------------------------------------------------
// The breaker resolver
// ---------------------------------------------------------------------------------------------

/// A small vocabulary: token texts as bytes.
fn texts() -> Vec<Vec<u8>> {
    let mut t: Vec<Vec<u8>> = [
        "a", "b", "x\n", "\n\n", "ab", "aa", "ca", "*", "a*", "é", "", "", ":", "q:",
    ]
    .iter()
    .map(|s| s.as_bytes().to_vec())
    .collect();
    t[10] = vec![0xC3]; // a byte-level token: the first byte of "é"
    t[11] = vec![0xA9]; // its second byte
    t
}

fn encode_small(s: &[u8]) -> Result<Vec<u32>, String> {
    match s {
        b"b" => Ok(vec![1]),
        b"ab" => Ok(vec![4]),
        [0xA9] => Ok(vec![11]),
        _ => Err(format!("cannot encode {s:?}")),
    }
}

#[test]
fn resolver_finds_containing_and_overlapping_tokens() {
    let texts = texts();
    let calls = Cell::new(0);
    let encode = |s: &[u8]| {
        calls.set(calls.get() + 1);
        encode_small(s)
    };
    // "ab": token 4 contains it -> [4]. Tokens ending with "a" (a proper prefix): "a" (0),
    // "aa" (5, at position 1; at position 0 "aa" mismatches "ab"), "ca" (6): tail "b" -> [1].
    // "a*" (8) mismatches at '*'.
    let got = resolve_sequence_breakers(&["ab"], &texts, encode).unwrap();
    assert_eq!(got, vec![vec![0, 1], vec![4], vec![5, 1], vec![6, 1]]);
    assert_eq!(calls.get(), 1, "the tail \"b\" is encoded once");

    // "aab": "aa" (5) ends with "aa" (tail "b" -> 1) and with "a" (tail "ab" -> 4); "a" (0) and
    // "ca" (6) end with "a" (tail "ab"); "ab" (4) and "a*" (8) mismatch at position 1.
    let got = resolve_sequence_breakers(&["aab"], &texts, encode_small).unwrap();
    assert_eq!(got, vec![vec![0, 4], vec![5, 1], vec![5, 4], vec![6, 4]]);

    // "é" = C3 A9: token 9 contains it; token 10 (C3) ends with its first byte, tail A9 -> 11.
    let got = resolve_sequence_breakers(&["é"], &texts, encode_small).unwrap();
    assert_eq!(got, vec![vec![9], vec![10, 11]]);

    // The defaults on this vocabulary: "\n" in 2 and 3, ":" in 12 and 13, "\"" nowhere, "*" in
    // 7 and 8. One-byte breakers never need the encoder.
    assert_eq!(DRY_DEFAULT_SEQUENCE_BREAKERS, ["\n", ":", "\"", "*"]);
    let got = resolve_sequence_breakers(&DRY_DEFAULT_SEQUENCE_BREAKERS, &texts, |_: &[u8]| {
        Err::<Vec<u32>, _>("not called")
    })
    .unwrap();
    assert_eq!(
        got,
        vec![vec![2], vec![3], vec![7], vec![8], vec![12], vec![13]]
    );

    // Several breakers: the union, sorted, without duplicates.
    let got = resolve_sequence_breakers(&["\n", "\n", "ab"], &texts, encode_small).unwrap();
    assert_eq!(
        got,
        vec![
            vec![0, 1],
            vec![2],
            vec![3],
            vec![4],
            vec![5, 1],
            vec![6, 1]
        ]
    );
}

#[test]
fn resolver_truncates_tails_to_20_tokens() {
    // "zk" ends with "k", the first byte of a 26-byte breaker: the tail is the other 25 bytes,
    // one token per byte (id 100 + byte), truncated to 20.
    let texts = ["zk".as_bytes(), b"y"];
    let breaker = "kABCDEFGHIJKLMNOPQRSTUVWXY";
    let got = resolve_sequence_breakers(&[breaker], &texts, |s: &[u8]| {
        Ok::<_, String>(s.iter().map(|&b| 100 + u32::from(b)).collect())
    })
    .unwrap();
    let mut want = vec![0u32];
    want.extend(breaker.bytes().skip(1).take(20).map(|b| 100 + u32::from(b)));
    assert_eq!(got, vec![want]);
    // And such a breaker is accepted by Dry (21 tokens).
    Dry::new(0.8, 1.75, 2, -1, got).unwrap();
}

#[test]
fn resolver_bounds_and_errors_name_the_field() {
    let texts = texts();
    let ok = |b: &[&str]| resolve_sequence_breakers(b, &texts, encode_small);
    assert_eq!(ok(&[""]).unwrap_err().field, "dry_sequence_breakers");
    let b40 = "\"".repeat(40);
    let b41 = "\"".repeat(41);
    assert_eq!(ok(&[b40.as_str()]).unwrap(), Vec::<Vec<u32>>::new());
    assert_eq!(
        ok(&[b41.as_str()]).unwrap_err().field,
        "dry_sequence_breakers"
    );
    let many: Vec<&str> = vec!["\""; 64];
    assert!(ok(&many).is_ok());
    let many: Vec<&str> = vec!["\""; 65];
    assert_eq!(ok(&many).unwrap_err().field, "dry_sequence_breakers");
    // "bz": "ab" (4) ends with "b", whose tail "z" the encoder rejects.
    let e = ok(&["bz"]).unwrap_err();
    assert_eq!(e.field, "dry_sequence_breakers");
    assert!(e.value.contains("cannot encode"), "{e}");
}

// ---------------------------------------------------------------------------------------------
// No-repeat n-grams
// ---------------------------------------------------------------------------------------------

/// Hugging Face's definition: with `cur` tokens, nothing while `cur + 1 < n`; else the tokens
/// following every earlier n-gram whose first n - 1 tokens equal the last n - 1 tokens.
fn ngram_oracle(seq: &[u32], n: usize) -> BTreeSet<u32> {
    let cur = seq.len();
    if cur + 1 < n {
        return BTreeSet::new();
    }
    let key = &seq[cur + 1 - n..];
    seq.windows(n)
        .filter(|g| g[..n - 1] == *key)
        .map(|g| g[n - 1])
        .collect()
}

/// Hugging Face's encoder variant: the key is the last n - 1 generated tokens (nothing while
/// fewer were generated), looked up in the encoder input's n-grams.
fn encoder_oracle(encoder: &[u32], generated: &[u32], n: usize) -> BTreeSet<u32> {
    if generated.len() + 1 < n {
        return BTreeSet::new();
    }
    let key = &generated[generated.len() + 1 - n..];
    encoder
        .windows(n)
        .filter(|g| g[..n - 1] == *key)
        .map(|g| g[n - 1])
        .collect()
}

fn banned_in(row: &[f32], before: &[f32]) -> BTreeSet<u32> {
    (0..row.len() as u32)
        .filter(|&i| row[i as usize] == NEG && before[i as usize] != NEG)
        .collect()
}

fn set(ids: &[u32]) -> BTreeSet<u32> {
    ids.iter().copied().collect()
}

#[test]
fn no_repeat_ngram_tables() {
    let row = [0.0f32; 6];
    let mut p = NoRepeatNGram::new(2).unwrap();
    // 1 2 3 1: bigrams (1,2) (2,3) (3,1); last token 1 -> ban 2.
    assert_eq!(
        banned_in(&after_reset(&mut p, &[1, 2, 3, 1], &row), &row),
        set(&[2])
    );
    // + 3: new bigram (1,3); last 3 -> (3,1): ban 1.
    p.accept(3);
    assert_eq!(banned_in(&applied(&mut p, &row), &row), set(&[1]));
    // + 1: (3,1) again; last 1 -> (1,2) and (1,3): ban 2 and 3.
    p.accept(1);
    assert_eq!(banned_in(&applied(&mut p, &row), &row), set(&[2, 3]));
    assert_eq!(p.banned_tokens(), &[2, 3]); // first-seen order

    // n = 3 on 1 2 1 2: trigrams (1,2,1) (2,1,2); key (1,2) -> ban 1.
    let mut p = NoRepeatNGram::new(3).unwrap();
    assert_eq!(
        banned_in(&after_reset(&mut p, &[1, 2, 1, 2], &row), &row),
        set(&[1])
    );
    // Length boundary: 5 5 has no trigram (cur 2, 2 + 1 >= 3 but nothing to match): nothing;
    // 5 5 5: trigram (5,5,5), key (5,5): ban 5.
    assert!(banned_in(&after_reset(&mut p, &[5, 5], &row), &row).is_empty());
    assert_eq!(
        banned_in(&after_reset(&mut p, &[5, 5, 5], &row), &row),
        set(&[5])
    );
    // cur + 1 < n: nothing at all (one token, n = 3).
    assert!(banned_in(&after_reset(&mut p, &[5], &row), &row).is_empty());

    // n = 1: every token already in the sequence; nothing for an empty sequence.
    let mut p = NoRepeatNGram::new(1).unwrap();
    assert_eq!(
        banned_in(&after_reset(&mut p, &[4, 2, 4], &row), &row),
        set(&[2, 4])
    );
    assert!(banned_in(&after_reset(&mut p, &[], &row), &row).is_empty());
    p.accept(0);
    assert_eq!(banned_in(&applied(&mut p, &row), &row), set(&[0]));

    // -inf stays -inf; other entries are untouched.
    let mut p = NoRepeatNGram::new(2).unwrap();
    let got = after_reset(&mut p, &[1, 2, 3, 1], &[0.5, 1.0, NEG, 2.0, -1.0, 0.0]);
    assert_eq!(got, [0.5, 1.0, NEG, 2.0, -1.0, 0.0]);
}

#[test]
fn encoder_no_repeat_ngram_tables() {
    let row = [0.0f32; 10];
    let mut p = EncoderNoRepeatNGram::new(2).unwrap();
    // Encoder (prompt) 1 2 3: bigrams (1,2) (2,3). Nothing generated: no key, nothing.
    assert!(banned_in(&after_reset(&mut p, &[1, 2, 3], &row), &row).is_empty());
    p.accept(2); // key (2) -> ban 3
    assert_eq!(banned_in(&applied(&mut p, &row), &row), set(&[3]));
    p.accept(9); // key (9): nothing
    assert!(banned_in(&applied(&mut p, &row), &row).is_empty());
    p.accept(1); // key (1) -> 2
    assert_eq!(banned_in(&applied(&mut p, &row), &row), set(&[2]));
    p.accept(3); // key (3): the prompt's last token starts no bigram; generated (1,3) is not banned
    assert!(banned_in(&applied(&mut p, &row), &row).is_empty());

    // n = 1: every prompt token, from the first step.
    let mut p = EncoderNoRepeatNGram::new(1).unwrap();
    assert_eq!(
        banned_in(&after_reset(&mut p, &[1, 2, 3], &row), &row),
        set(&[1, 2, 3])
    );
    p.accept(7);
    assert_eq!(banned_in(&applied(&mut p, &row), &row), set(&[1, 2, 3]));

    // n = 3, prompt 1 2 3 1 2 4: generated [1] -> nothing; [1, 2] -> 3 and 4.
    let mut p = EncoderNoRepeatNGram::new(3).unwrap();
    p.reset(&[1, 2, 3, 1, 2, 4]);
    p.accept(1);
    assert!(banned_in(&applied(&mut p, &row), &row).is_empty());
    p.accept(2);
    assert_eq!(banned_in(&applied(&mut p, &row), &row), set(&[3, 4]));
    assert_eq!(p.banned_tokens(), &[3, 4]);
}

#[test]
fn ngram_processors_match_the_oracles_on_random_sequences() {
    let mut g = SplitMix(0x96);
    for case in 0..600 {
        let vocab = [2usize, 3, 7, 50][case % 4];
        let alphabet = (2 + g.below(3)).min(vocab as u64);
        let n = 1 + g.below(5) as usize;
        let len = g.below(60) as usize;
        let seq: Vec<u32> = (0..len).map(|_| g.below(alphabet) as u32).collect();
        let split = g.below(len as u64 + 1) as usize;
        let row = random_row(&mut g, vocab);
        let what =
            |step: usize| format!("case {case}: n {n}, seq {seq:?}, split {split}, step {step}");

        let mut p = NoRepeatNGram::new(n as i64).unwrap();
        let mut e = EncoderNoRepeatNGram::new(n as i64).unwrap();
        p.reset(&seq[..split]);
        e.reset(&seq[..split]);
        for step in split..=len {
            if step > split {
                p.accept(seq[step - 1]);
                e.accept(seq[step - 1]);
            }
            let banned = ngram_oracle(&seq[..step], n);
            let want: Vec<f32> = (0..vocab as u32)
                .map(|i| {
                    if banned.contains(&i) {
                        NEG
                    } else {
                        row[i as usize]
                    }
                })
                .collect();
            assert_eq!(
                applied(&mut p, &row),
                want,
                "{} no_repeat_ngram",
                what(step)
            );
            assert_eq!(set(p.banned_tokens()), banned, "{}", what(step));
            assert_eq!(
                p.banned_tokens().len(),
                banned.len(),
                "{}: duplicates",
                what(step)
            );

            let banned = encoder_oracle(&seq[..split], &seq[split..step], n);
            let want: Vec<f32> = (0..vocab as u32)
                .map(|i| {
                    if banned.contains(&i) {
                        NEG
                    } else {
                        row[i as usize]
                    }
                })
                .collect();
            assert_eq!(applied(&mut e, &row), want, "{} encoder", what(step));
            assert_eq!(
                e.banned_tokens().len(),
                banned.len(),
                "{}: duplicates",
                what(step)
            );
        }
    }
}

#[test]
fn ngram_reset_accept_and_clone() {
    let row = [0.0f32; 6];
    let mut p = NoRepeatNGram::new(2).unwrap();
    p.reset(&[1, 2, 3, 1]);
    let mut c = p.clone();
    let mut boxed = p.box_clone();
    p.accept(2); // 1 2 3 1 2: key (2) -> 3
    c.accept(3); // 1 2 3 1 3: key (3) -> 1
    assert_eq!(banned_in(&applied(&mut p, &row), &row), set(&[3]));
    assert_eq!(banned_in(&applied(&mut c, &row), &row), set(&[1]));
    assert_eq!(banned_in(&applied(boxed.as_mut(), &row), &row), set(&[2])); // still 1 2 3 1
    p.reset(&[]);
    assert!(p.banned_tokens().is_empty());

    let mut e = EncoderNoRepeatNGram::new(2).unwrap();
    e.reset(&[1, 2, 3]);
    let mut c = e.clone();
    e.accept(1); // -> 2
    c.accept(2); // -> 3
    assert_eq!(banned_in(&applied(&mut e, &row), &row), set(&[2]));
    assert_eq!(banned_in(&applied(&mut c, &row), &row), set(&[3]));
    e.reset(&[4, 5]);
    assert!(
        e.banned_tokens().is_empty(),
        "the generated tokens are forgotten"
    );
    e.accept(4);
    assert_eq!(e.banned_tokens(), &[5]);
}

#[test]
fn ngram_parameter_errors_and_ids() {
    for n in [0, -1, i64::MIN] {
        assert_eq!(
            NoRepeatNGram::new(n).unwrap_err().field,
            "no_repeat_ngram_size"
        );
        assert_eq!(
            EncoderNoRepeatNGram::new(n).unwrap_err().field,
            "encoder_no_repeat_ngram_size"
        );
    }
    assert_eq!(NoRepeatNGram::new(1).unwrap().ngram_size(), 1);
    assert_eq!(
        EncoderNoRepeatNGram::new(7).unwrap().encoder_ngram_size(),
        7
    );

    let mut chain = SamplerChain::new(Selection::greedy());
    chain.push(NoRepeatNGram::new(2).unwrap());
    chain.reset(&[1, 8]);
    let e = chain.sample(&[0.0; 4], &ctx0(), 0).unwrap_err();
    assert!(
        matches!(
            e,
            SampleError::TokenIdOutOfRange {
                field: "prompt_ids",
                token_id: 8,
                ..
            }
        ),
        "{e:?}"
    );
    let mut chain = SamplerChain::new(Selection::greedy());
    chain.push(EncoderNoRepeatNGram::new(2).unwrap());
    chain.reset(&[1]);
    chain.accept(5);
    let e = chain.sample(&[0.0; 4], &ctx0(), 0).unwrap_err();
    assert!(
        matches!(
            e,
            SampleError::TokenIdOutOfRange {
                field: "output_ids",
                token_id: 5,
                ..
            }
        ),
        "{e:?}"
    );
}

// ---------------------------------------------------------------------------------------------
// Chain configuration
// ---------------------------------------------------------------------------------------------

#[test]
fn config_builds_the_repetition_processors() {
    let json = r#"[
        {"dry": {"multiplier": 0.8, "base": 1.75, "allowed_length": 2, "penalty_last_n": -1,
                 "sequence_breakers": [[5], [4, 1]]}},
        {"no_repeat_ngram": {"ngram_size": 2}},
        {"encoder_no_repeat_ngram": {"encoder_ngram_size": 3}},
        {"greedy": {}}
    ]"#;
    let config: Vec<ProcessorConfig> = serde_json::from_str(json).unwrap();
    assert_eq!(
        config.iter().map(ProcessorConfig::name).collect::<Vec<_>>(),
        [
            "dry",
            "no_repeat_ngram",
            "encoder_no_repeat_ngram",
            "greedy"
        ]
    );
    assert_eq!(
        config[0],
        ProcessorConfig::Dry {
            multiplier: 0.8,
            base: 1.75,
            allowed_length: 2,
            penalty_last_n: -1,
            sequence_breakers: Some(vec![vec![5], vec![4, 1]]),
        }
    );
    let text = serde_json::to_string(&config).unwrap();
    let again: Vec<ProcessorConfig> = serde_json::from_str(&text).unwrap();
    assert_eq!(again, config);
    SamplerChain::from_config(&config).unwrap();

    // Defaults: llama.cpp's (multiplier 0 = off), breakers absent.
    let c: Vec<ProcessorConfig> = serde_json::from_str(r#"[{"dry": {}}]"#).unwrap();
    assert_eq!(
        c[0],
        ProcessorConfig::Dry {
            multiplier: 0.0,
            base: 1.75,
            allowed_length: 2,
            penalty_last_n: -1,
            sequence_breakers: None,
        }
    );

    // The DRY entry alone: its breaker [4, 1] cuts the repeat of H to 2 (see the table test),
    // so token 4 gets 0.8 * 1.75^0 = 0.8.
    let mut p = config[0].to_processor().unwrap().unwrap();
    let got = after_reset(p.as_mut(), &H, &L6);
    assert_row(&got, &[0.5, 1.0, -1.0, 2.0, -0.55, 3.0], "dry from config");
}

#[test]
fn config_errors_name_the_field() {
    let bad = |json: &str, field: &str| {
        let c: Vec<ProcessorConfig> = serde_json::from_str(json).unwrap();
        match SamplerChain::from_config(&c) {
            Err(ChainError::InvalidParams {
                index: 0, source, ..
            }) => {
                assert_eq!(source.field, field, "{json}")
            }
            other => panic!("{json}: {other:?}"),
        }
    };
    bad(r#"[{"dry": {"base": 0.5}}, {"greedy": {}}]"#, "dry_base");
    bad(
        r#"[{"dry": {"multiplier": "nan"}}, {"greedy": {}}]"#,
        "dry_multiplier",
    );
    bad(
        r#"[{"dry": {"allowed_length": -1}}, {"greedy": {}}]"#,
        "dry_allowed_length",
    );
    bad(
        r#"[{"dry": {"penalty_last_n": -2}}, {"greedy": {}}]"#,
        "dry_penalty_last_n",
    );
    bad(
        r#"[{"dry": {"sequence_breakers": [[]]}}, {"greedy": {}}]"#,
        "dry_sequence_breakers",
    );
    bad(
        r#"[{"no_repeat_ngram": {"ngram_size": 0}}, {"greedy": {}}]"#,
        "no_repeat_ngram_size",
    );
    bad(
        r#"[{"encoder_no_repeat_ngram": {"encoder_ngram_size": -3}}, {"greedy": {}}]"#,
        "encoder_no_repeat_ngram_size",
    );
    // Unknown fields are rejected by serde.
    assert!(serde_json::from_str::<Vec<ProcessorConfig>>(r#"[{"dry": {"mult": 1}}]"#).is_err());
    assert!(
        serde_json::from_str::<Vec<ProcessorConfig>>(r#"[{"no_repeat_ngram": {}}]"#).is_err(),
        "ngram_size is required"
    );
}
